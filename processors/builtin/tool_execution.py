"""`ToolExecutionLogitsProcessor`: run tool calls the model writes, and splice their results in.

For RL rollouts (the verl/vLLM pattern): when the generated text of a request that enables it
closes a call such as `<function>multiply(3, 302)</function>`, the named function from the
operator's registry runs (with a time limit) and `<results>906</results>` is forced into the
output before generation continues. Errors (unknown function, bad arguments, an exception, a
time-out) become the result text. A request can make several calls.

The registry is given at start-up, never by a request:

    python -m fastdeploy_lp.entrypoints.openai.api_server \\
        --logits-processors ToolExecutionLogitsProcessor --tool-functions my_tools:REGISTRY

    {"logits_processors_args": {"tool_execution": true}}

Arguments are Python literals only (`ast.literal_eval`), so a call can never run other code.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib
import logging
from typing import Callable

from pydantic import BaseModel, Field

from ..base import LogitsProcessor

logger = logging.getLogger(__name__)


class ToolExecutionArgs(BaseModel):
    tool_execution: bool | None = None
    tool_call_start: str = Field("<function>", min_length=1)
    tool_call_end: str = Field("</function>", min_length=1)
    tool_timeout: float = Field(5.0, gt=0, le=60)


def load_tool_functions(spec: str | dict | None) -> dict[str, Callable]:
    """`pkg.module:NAME` naming a dict of callables (or the dict itself) → that dict, checked."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"tool_functions: expected 'package.module:REGISTRY', got {spec!r}")
        try:
            spec = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"tool_functions: cannot load {spec!r}: {e}") from e
    if not isinstance(spec, dict) or not all(isinstance(k, str) and callable(v) for k, v in spec.items()):
        raise ValueError("tool_functions: must be a dict of name -> callable")
    return dict(spec)


def parse_call(text: str) -> tuple[str, list, dict]:
    """`name(1, "a", k=2)` → ("name", [1, "a"], {"k": 2}); literals only."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse call {text!r}") from e
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a function call: {text!r}")
    args = [ast.literal_eval(a) for a in node.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    return node.func.id, args, kwargs


class ToolExecutionLogitsProcessor(LogitsProcessor):
    args_model = ToolExecutionArgs
    argmax_invariant = True  # it never edits logits: results arrive as forced tokens

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return bool(args.tool_execution)

    def __init__(self, fd_config):
        super().__init__(fd_config)
        self.functions = getattr(fd_config, "tool_functions", None) or {}
        self.tokenizer = fd_config.tokenizer
        self._scanned: dict[str, int] = {}  # request id -> output tokens already searched for calls
        self._settings: dict[str, ToolExecutionArgs] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tool-call")

    def update_state(self, share_inputs):
        live = set()
        for slot, stopped in enumerate(share_inputs["stop_flags"]):
            args = share_inputs["logits_processors_args"][slot]
            if stopped or not args.tool_execution:
                continue
            rid = share_inputs["req_ids"][slot]
            live.add(rid)
            if rid not in self._settings:  # the args hold only the keys the request set; add defaults
                self._settings[rid] = ToolExecutionArgs.model_validate(
                    {k: v for k, v in args.items() if k in ToolExecutionArgs.model_fields and v is not None})
            settings = self._settings[rid]
            output = share_inputs["output_ids"][slot]
            start = self._scanned.get(rid, 0)
            text = self.tokenizer.decode(output[start:])
            end = text.find(settings.tool_call_end)
            if end < 0:
                continue
            opened = text.rfind(settings.tool_call_start, 0, end)
            if opened < 0:  # a stray end marker: not a call, look past it next time
                self._scanned[rid] = len(output)
                continue
            call = text[opened + len(settings.tool_call_start):end]
            result = self.tokenizer.encode(f"<results>{self._run(call, settings.tool_timeout)}</results>")
            share_inputs["forced_tokens"][slot].extend(result)
            self._scanned[rid] = len(output) + len(result)
        self._scanned = {k: v for k, v in self._scanned.items() if k in live}
        self._settings = {k: v for k, v in self._settings.items() if k in live}

    def _run(self, call: str, timeout: float) -> str:
        try:
            name, args, kwargs = parse_call(call)
        except ValueError as e:
            return f"error: {e}"
        fn = self.functions.get(name)
        if fn is None:
            return f"error: unknown function {name!r}"
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return str(future.result(timeout=timeout))
        except concurrent.futures.TimeoutError:
            return f"error: {name} timed out after {timeout:g}s"
        except Exception as e:  # the tool's own failure is the model's to read, not ours
            return f"error: {type(e).__name__}: {e}"
