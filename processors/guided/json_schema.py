"""JSON-schema helpers: OpenAI `strict` semantics and a bound on nesting, before llguidance sees it."""

from __future__ import annotations

from typing import Any

MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document itself

# Keywords whose value is a subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


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


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` with OpenAI strict semantics: every object subschema that does not say
    otherwise gets `"additionalProperties": false`, so the output has no keys beyond `properties`.

    `allOf` branches are left as written (closing each branch would make their union unsatisfiable).
    """
    check_depth(schema, "json_schema")
    return _strict(schema)


def _strict(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types) or (
        types is None and "properties" in out)
    if is_object and "additionalProperties" not in out and "$ref" not in out:
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _strict(s) for k, s in out[key].items()}
    return out
