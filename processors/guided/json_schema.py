"""JSON-schema helpers applied before llguidance sees a schema: a bound on nesting, OpenAI `strict`
semantics, and dropping `format` values that JSON Schema does not define."""

from __future__ import annotations

from typing import Any

MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document itself

# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")

# The formats JSON Schema defines (drafts 7 to 2020-12). Any other value is a custom annotation that
# no validator checks (`jsonschema` ignores it), so it is dropped rather than refused; standard
# formats llguidance lacks (uri-reference, regex, ...) are still refused.
STANDARD_FORMATS = frozenset(
    "date-time date time duration email idn-email hostname idn-hostname ipv4 ipv6 uri uri-reference iri "
    "iri-reference uuid uri-template json-pointer relative-json-pointer regex".split())


def schema_depth(value: Any) -> int:
    """Nesting depth of a JSON value, computed without recursion (hostile input is deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def check_depth(schema: Any, field: str) -> None:
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{field}: the schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are supported")


def json_format_options(whitespace_pattern: str | None) -> dict:
    """llguidance's `x-guidance` options for the whitespace between JSON tokens.

    None (the default) is the layout of Python's `json.dumps`, `{"a": 1, "b": [1, 2]}`: one
    space after `:` and `,`, nothing else. Every model has seen it, and it cannot run on: with
    llguidance's own default (any whitespace, unbounded) a small model can spend its whole token
    budget on newlines. "" is no whitespace at all; any other value is the regex whitespace runs
    must match.
    """
    if whitespace_pattern is None:
        return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if whitespace_pattern == "":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` with OpenAI strict semantics: every object subschema that does not say
    otherwise gets `"additionalProperties": false`, so the output has no keys beyond `properties`.

    `allOf` branches are left as written (closing each branch would make their union unsatisfiable).
    """
    check_depth(schema, "json_schema")
    return _map_schemas(schema, _close_object)


def drop_custom_formats(schema: dict) -> dict:
    """A copy of `schema` without `format` values outside `STANDARD_FORMATS` (e.g. `topic`, `byte`)."""
    return _map_schemas(schema, _drop_custom_format)


def _close_object(node: dict) -> dict:
    types = node.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or (
        types is None and "properties" in node)
    if is_object and "additionalProperties" not in node and "$ref" not in node:
        node["additionalProperties"] = False
    return node


def _drop_custom_format(node: dict) -> dict:
    if isinstance(node.get("format"), str) and node["format"] not in STANDARD_FORMATS:
        del node["format"]
    return node


def _map_schemas(node: Any, fn) -> Any:
    """Copy a schema, applying `fn` to a copy of every subschema (strictness leaves `allOf` alone)."""
    if not isinstance(node, dict):
        return node
    out = fn(dict(node))
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _map_schemas(out[key], fn)
        elif key == "items" and isinstance(out.get(key), list):  # draft-4 tuple form
            out[key] = [_map_schemas(s, fn) for s in out[key]]
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_map_schemas(s, fn) for s in out[key]]
    if isinstance(out.get("allOf"), list) and fn is not _close_object:
        out["allOf"] = [_map_schemas(s, fn) for s in out["allOf"]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _map_schemas(s, fn) for k, s in out[key].items()}
    return out
