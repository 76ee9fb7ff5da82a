"""Output constraints in a request: the fields that carry one and how they become the request's
one `GuidedDecodingParams`.

Every form is read: OpenAI's `response_format` (plus TensorRT-LLM's `json`, `regex`, `ebnf`,
`structural_tag` types), the `guided_*` fields (vLLM < 0.10, TensorRT-LLM), NVIDIA NIM's
`nvext.guided_*`, vLLM's `structured_outputs`, and SGLang's top-level `regex` and `ebnf` (the
forms SGLang's router keeps when it rebuilds a body). The request models of `protocol.py` hold these
fields and read them through the functions here, so chat and completions share one meaning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fastdeploy_lp.options import json_object
from fastdeploy_lp.sampling_params import GuidedDecodingParams

_NESTED = ConfigDict(extra="allow", strict=True, populate_by_name=True)
_SCHEMA = (dict, bool)  # a JSON schema given as an object or its text: an object, or true/false

# The request fields that carry an output constraint, all read by chat and completions. An API
# that reads only some of them refuses the others (`refuse_constraint_fields`): ignoring one would
# run the request unconstrained.
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structural_tag", "guided_whitespace_pattern", "structured_outputs", "nvext",
                     "guided_decoding_backend", "regex", "ebnf")


def refuse_constraint_fields(extra: dict[str, Any] | None, read: tuple[str, ...], instead: str) -> None:
    """A 400 (ValueError) naming the first constraint field in a request's unread `extra` fields."""
    for name in CONSTRAINT_FIELDS:
        if name not in read and (extra or {}).get(name) is not None:
            raise ValueError(f"{name}: not read on this endpoint; {instead}")


class JsonSchemaSpec(BaseModel):
    model_config = _NESTED
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, plus the TensorRT-LLM forms `json`, `regex`, `ebnf`, `structural_tag`."""

    model_config = _NESTED
    type: Literal["text", "json_object", "json_schema", "json", "regex", "ebnf", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    schema_: dict[str, Any] | str | None = Field(None, alias="schema", description="For type 'json'.")
    regex: str | None = None
    ebnf: str | None = None
    format: dict[str, Any] | None = Field(None, description="For type 'structural_tag' (triggered tags).")
    structures: list[dict[str, Any]] | None = Field(None, description="For type 'structural_tag' (older form).")
    triggers: list[str] | None = None


class NvExt(BaseModel):
    """NVIDIA NIM's extension object: its constraint fields, as NIM documents them; other keys are
    passed to custom backends untouched."""

    model_config = _NESTED
    guided_decoding_backend: str | None = None
    guided_json: dict[str, Any] | str | bool | None = Field(None, description="A JSON schema (object or string).")
    guided_choice: list[str] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = Field(None, description="EBNF (GBNF `root ::= ...`) or Lark grammar.")
    guided_whitespace_pattern: str | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object (vLLM >= 0.10, where the `guided_*` fields were removed).
    Unknown keys are a 400: each names a constraint option, and none is silently dropped."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_: dict[str, Any] | str | bool | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF (GBNF) or Lark grammar.")
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    whitespace_pattern: str | None = Field(None, description="Regex of the whitespace allowed between JSON tokens.")
    disable_any_whitespace: bool | None = Field(None, description="JSON without any whitespace between tokens.")
    disable_additional_properties: bool | None = Field(
        None, description="Objects without `additionalProperties` get `false` (no extra keys).")
    disable_fallback: bool | None = Field(None, description="Accepted: there is no fallback backend to disable.")
    close_on_length: bool | None = Field(
        None, description="At max_tokens, close the JSON (any JSON constraint of the request, response_format "
                          "included) with a short valid completion: finish_reason stays 'length' and the choice "
                          "says closed_on_length. Default: the server's --guided-close-on-length.")


def request_constraint(req, tool_constraint: GuidedDecodingParams | None = None) -> GuidedDecodingParams | None:
    """The one output constraint `req` asks for, or None. Raises ValueError("field: ...").

    Naming two is a 400, and so is a whitespace rule without a JSON constraint. `tool_constraint`
    is the constraint the request's tools imply (chat); it excludes the other forms.
    """
    sources = constraint_sources(req)
    if tool_constraint is not None and sources:
        raise ValueError(f"{sources[0][0]}: cannot be combined with tools (a tool call is itself an output "
                         "constraint); send one or the other")
    if len(sources) > 1:
        raise ValueError(f"{sources[1][0]}: only one output constraint per request; got "
                         f"{', '.join(f for f, _ in sources)}")
    guided = tool_constraint if tool_constraint is not None else (
        GuidedDecodingParams(**sources[0][1]) if sources else None)
    ws_field, ws = whitespace_rule(req)
    if ws_field is not None:
        if guided is None or not set(guided.kinds()) & {"json", "json_object", "structural_tag"}:
            raise ValueError(f"{ws_field}: only applies together with a JSON constraint, a structural tag, "
                             "or tools")
        guided.whitespace_pattern = ws
    so = req.structured_outputs
    if so is not None and so.disable_additional_properties:
        if guided is None or guided.kinds() != ["json"]:
            raise ValueError("structured_outputs.disable_additional_properties: only applies to a JSON schema")
        guided.disable_additional_properties = True
    if so is not None and so.close_on_length is not None:
        if guided is None or not set(guided.kinds()) <= {"json", "json_object"}:
            raise ValueError("structured_outputs.close_on_length: only applies together with a JSON constraint "
                             "(response_format json_schema or json_object, guided_json, structured_outputs.json)")
        guided.close_on_length = so.close_on_length
    return guided


def constraint_sources(req) -> list[tuple[str, dict[str, Any]]]:
    """(request field, GuidedDecodingParams kwargs) of every constraint `req` names."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", _response_format_constraint(rf)))
    for prefix, holder in (("", req), ("nvext.", req.nvext)):
        if holder is None:
            continue
        if holder.guided_json is not None:
            schema = json_object(prefix + "guided_json", holder.guided_json, _SCHEMA)
            found.append((prefix + "guided_json", {"json": schema}))
        for name, kind in (("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(holder, name) is not None:
                found.append((prefix + name, {kind: getattr(holder, name)}))
    for name, kind in (("regex", "regex"), ("ebnf", "grammar")):  # SGLang's names
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    if req.structural_tag is not None:
        found.append(("structural_tag", {"structural_tag": json_object("structural_tag", req.structural_tag)}))
    so = req.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar), ("structural_tag", so.structural_tag)):
            if value is None:
                continue
            field = f"structured_outputs.{kind}"
            if kind == "json":
                value = json_object(field, value, _SCHEMA)
            elif kind == "structural_tag":
                value = json_object(field, value)
            found.append((field, {kind: value}))
        if so.json_object:
            found.append(("structured_outputs.json_object", {"json_object": True}))
    return found


def whitespace_rule(req) -> tuple[str | None, str | None]:
    """(field, JSON whitespace regex) `req` sets; "" means no whitespace at all."""
    nv = req.nvext.guided_whitespace_pattern if req.nvext is not None else None
    given = [(f, v) for f, v in (("guided_whitespace_pattern", req.guided_whitespace_pattern),
                                 ("nvext.guided_whitespace_pattern", nv)) if v is not None]
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            given.append(("structured_outputs.whitespace_pattern", so.whitespace_pattern))
        if so.disable_any_whitespace:
            given.append(("structured_outputs.disable_any_whitespace", ""))
    if len(given) > 1:
        raise ValueError(f"{given[1][0]}: only one JSON whitespace rule per request; got "
                         f"{', '.join(f for f, _ in given)}")
    return given[0] if given else (None, None)


def _response_format_constraint(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise ValueError("response_format.json_schema: required when type is 'json_schema'")
        if rf.json_schema.schema_ is None:  # OpenAI allows it; it means "any JSON object"
            return {"json_object": True}
        if rf.json_schema.schema_ is False:
            raise ValueError("response_format.json_schema.schema: the schema false allows no output")
        if rf.json_schema.strict and isinstance(rf.json_schema.schema_, dict):
            # OpenAI's {"schema", "strict"} object: the guided-decoding compiler closes every object
            return {"json": {"schema": rf.json_schema.schema_, "strict": True}}
        return {"json": rf.json_schema.schema_}
    if rf.type == "json":
        if rf.schema_ is None:
            raise ValueError("response_format.schema: required when type is 'json'")
        return {"json": json_object("response_format.schema", rf.schema_, _SCHEMA)}
    if rf.type == "regex":
        if rf.regex is None:
            raise ValueError("response_format.regex: required when type is 'regex'")
        return {"regex": rf.regex}
    if rf.type == "ebnf":
        if rf.ebnf is None:
            raise ValueError("response_format.ebnf: required when type is 'ebnf'")
        return {"grammar": rf.ebnf}
    # structural_tag: the `format` form or the older `structures` + `triggers` form, passed through
    if rf.format is None and rf.structures is None:
        raise ValueError("response_format.format: a structural_tag needs 'format' (or 'structures' and 'triggers')")
    return {"structural_tag": rf.model_dump(by_alias=True, exclude_none=True)}
