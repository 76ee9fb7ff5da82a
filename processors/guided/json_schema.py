"""JSON-schema helpers applied before llguidance sees a schema: a bound on nesting, OpenAI `strict`
semantics, dropping `format` values that JSON Schema does not define, and a cap on number length."""

from __future__ import annotations

from typing import Any

MAX_SCHEMA_DEPTH = 64  # JSON nesting of the schema document itself
# llguidance turns `multipleOf: 1e-N` into "at most N decimals" up to N = 10 and refuses finer steps
# (verified with 1.9.1), so the fraction of a capped number has at most this many digits.
MAX_FRACTION_DIGITS = 10
ANY_VALUE_DEF = "fdlp_json_value"  # the `$defs` entry of a number-capped "any JSON value"

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


def cap_numbers(schema: dict, digits: int) -> dict:
    """A copy of `schema` whose numbers have at most `digits` digits before the point and
    min(digits, MAX_FRACTION_DIGITS) after it, written without an exponent: llguidance's number
    lexeme is unbounded, and a model that starts `1.000000...` can spend its whole budget on it.

    JSON Schema has no length keyword for numbers, so the cap is a range (|x| < 10**digits) and a
    `multipleOf`, added to every `number` / `integer` subschema that does not bound itself tighter.
    Every place the schema allows any value (`{}`, `true`, including the whole schema) becomes a
    reference to an any-value schema whose numbers are capped the same way. Keys an object schema
    does not list (allowed unless `additionalProperties: false`) are left as llguidance has them.
    `not` and `if` are left alone (a bound there would widen what the schema allows), and so is
    `propertyNames` (keys are strings)."""
    cap = _NumberCap(digits)
    capped = _map_capped(schema, cap)
    if not cap.any_value_used:
        return capped
    defs = dict(capped.get("$defs") or {})
    defs[ANY_VALUE_DEF] = cap.any_value()
    return {**capped, "$defs": defs}


class _NumberCap:
    def __init__(self, digits: int):
        self.digits = digits
        self.limit = float(10 ** digits)
        self.step = float(f"1e-{min(digits, MAX_FRACTION_DIGITS)}")
        self.any_value_used = False

    def bound(self, node: dict) -> dict:
        types = node.get("type")
        types = types if isinstance(types, list) else [types]
        if "number" not in types and "integer" not in types:
            return node
        low = max([-self.limit] + [node[k] for k in ("minimum", "exclusiveMinimum") if _is_number(node.get(k))])
        high = min([self.limit] + [node[k] for k in ("maximum", "exclusiveMaximum") if _is_number(node.get(k))])
        if low >= self.limit or high <= -self.limit:  # the schema asks for numbers longer than the cap
            raise ValueError(f"a {'minimum' if low >= self.limit else 'maximum'} of {low if low >= self.limit else high} "
                             f"needs more than the {self.digits} digits a number may have before its point "
                             "(max_number_digits, the server's --guided-json-number-digits; 0: no cap)")
        if low == -self.limit:
            node["exclusiveMinimum"] = low
        if high == self.limit:
            node["exclusiveMaximum"] = high
        if "number" in types and "multipleOf" not in node:
            node["multipleOf"] = self.step
        return node

    def any_value(self) -> dict:
        ref = {"$ref": f"#/$defs/{ANY_VALUE_DEF}"}
        return {"anyOf": [{"type": "null"}, {"type": "boolean"}, self.bound({"type": "number"}),
                          {"type": "string"}, {"type": "array", "items": ref},
                          {"type": "object", "additionalProperties": ref}]}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _map_capped(node: Any, cap: _NumberCap) -> Any:
    """`_map_schemas` for `cap_numbers`: any-value subschemas become references, `not`/`if` stay."""
    if node is True or node == {}:
        cap.any_value_used = True
        return {"$ref": f"#/$defs/{ANY_VALUE_DEF}"}
    if not isinstance(node, dict):
        return node
    out = cap.bound(dict(node))
    for key in _ONE:
        if key in ("not", "if", "propertyNames"):
            continue
        if isinstance(out.get(key), (dict, bool)) and not (key == "additionalProperties" and out[key] is False):
            out[key] = _map_capped(out[key], cap)
        elif key == "items" and isinstance(out.get(key), list):
            out[key] = [_map_capped(s, cap) for s in out[key]]
    for key in _MANY + ("allOf",):
        if isinstance(out.get(key), list):
            out[key] = [_map_capped(s, cap) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _map_capped(s, cap) for k, s in out[key].items()}
    return out


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
