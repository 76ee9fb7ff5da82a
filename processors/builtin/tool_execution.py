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
from dataclasses import dataclass
from typing import Callable

from pydantic import BaseModel, Field

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.processors.base import LogitsProcessor, RequestFailures, ShareInputs
from fastdeploy_lp.processors.batch_state import BatchTracker
from fastdeploy_lp.processors.context import EngineContext

logger = logging.getLogger(__name__)
_RESULTS_START, _RESULTS_END = "<results>", "</results>"
MAX_TOOL_TIMEOUT_S = 60.0


class ToolExecutionArgs(BaseModel):
    tool_execution: bool | None = None
    tool_call_start: str = Field("<function>", min_length=1)
    tool_call_end: str = Field("</function>", min_length=1)
    tool_timeout: float = Field(5.0, gt=0, le=MAX_TOOL_TIMEOUT_S)


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


@dataclass
class _SlotCalls:
    settings: ToolExecutionArgs
    scanned: int  # output tokens already searched for calls


class ToolExecutionLogitsProcessor(LogitsProcessor):
    """Runs the tool calls a model writes and splices their results into the output.

    For RL rollouts (the verl/vLLM pattern): when a request's generated text closes a call such as
    `<function>multiply(3, 302)</function>`, the named function from the operator's registry
    (`LLM(tool_functions=...)`, `--tool-functions pkg.module:REGISTRY`; never named by a request)
    runs with a time limit, and `<results>906</results>` is forced into the output before
    generation goes on. Arguments are Python literals only. Errors (unknown function, bad
    arguments, an exception, a time-out) become the result text.

    Args:
        tool_execution (`bool`, *optional*):
            True enables the processor for the request.
        tool_call_start (`str`, *optional*, defaults to `"<function>"`):
            The text that opens a call.
        tool_call_end (`str`, *optional*, defaults to `"</function>"`):
            The text that closes a call (and runs it).
        tool_timeout (`float`, *optional*, defaults to 5.0):
            Seconds (0 < t <= 60) a call may take before its result is a time-out error. All four
            keys are read per request from `logits_processors_args`.

    Examples:

    A regex constraint stands in for a model trained to write calls:

    ```python
    >>> from fastdeploy_lp import LLM, GuidedDecodingParams, SamplingParams
    >>> llm = LLM(logits_processors=["ToolExecutionLogitsProcessor"],
    ...           tool_functions={"multiply": lambda a, b: a * b})  # the built-in default model
    >>> call = GuidedDecodingParams(regex="<function>multiply[(]3, 302[)]</function>(<results>[0-9]+</results>)?")
    >>> params = SamplingParams(temperature=0, max_tokens=40, guided_decoding=call,
    ...                         logits_processors_args={"tool_execution": True})
    >>> llm.generate("What is 3 times 302?", params, use_tqdm=False)[0].outputs.text
    '<function>multiply(3, 302)</function><results>906</results>'

    ```
    """
    args_model = ToolExecutionArgs
    argmax_invariant = True  # it never edits logits: results arrive as forced tokens
    uses_engine_context = True  # the operator's tool functions, and the tokenizer
    # A call may take its request's tool_timeout; the server's per-step limit must not cut it short.
    step_time_limit_s = MAX_TOOL_TIMEOUT_S + 1.0
    supports_speculation = True  # a call is never run for drafts: update_draft_state
    runs_in_place = True  # each tool call runs on its pool, waited for at most its tool_timeout

    @classmethod
    def is_enabled_by(cls, args, params=None) -> bool:
        return bool(args.tool_execution)

    def __init__(self, fd_config: FDConfig, context: EngineContext):
        super().__init__(fd_config)
        self.functions = context.tool_functions
        self.tokenizer = context.tokenizer
        self._batch = BatchTracker()
        self._calls: dict[int, _SlotCalls] = {}  # per enabled slot: its settings, output already searched
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tool-call")

    def update_state(self, share_inputs: ShareInputs) -> None:
        update = self._batch.update(share_inputs)
        for slot in update.removed:
            self._calls.pop(slot, None)
        for request in update.added:
            if request.args.tool_execution:  # the args hold only the keys the request set; add defaults
                settings = ToolExecutionArgs.model_validate(
                    {k: v for k, v in request.args.items() if k in ToolExecutionArgs.model_fields and v is not None})
                output = share_inputs["output_ids"][request.slot]
                self._calls[request.slot] = _SlotCalls(settings, self._answered(output))
        for slot, calls in self._calls.items():
            self._search(calls, share_inputs["output_ids"][slot], share_inputs["forced_tokens"][slot])

    def update_draft_state(self, share_inputs: ShareInputs) -> None:
        """A draft depth: nothing runs. Where the drafts so far close a call (or write any end
        marker, to be safe), plain decoding would run it and force its result at this position,
        so those rows are unusable: acceptance stops before them and the next step runs the call."""
        closing = {slot: "a tool call closes in the drafts: it runs at the next step" for slot, calls in
                   self._calls.items() if not share_inputs["stop_flags"][slot] and calls.settings.tool_call_end in
                   self.tokenizer.decode(share_inputs["output_ids"][slot][calls.scanned:])}
        if closing:
            raise RequestFailures(closing)

    def end_drafts(self, share_inputs: ShareInputs) -> None:
        """Nothing to bring back: the draft depths changed no state."""

    def _answered(self, output: list[int]) -> int:
        """Where the search starts for output a request brings along (it resumes after preemption):
        just past its last `</results>`. A call closed later, or open across the preemption, is
        found again; its result, if it was still queued, was dropped with the queue."""
        if not output:
            return 0
        answered = self.tokenizer.decode(output).count(_RESULTS_END)
        if not answered:
            return 0
        low, high = 1, len(output)  # the shortest prefix holding every `</results>`
        while low < high:
            mid = (low + high) // 2
            if self.tokenizer.decode(output[:mid]).count(_RESULTS_END) >= answered:
                high = mid
            else:
                low = mid + 1
        return low

    def _search(self, calls: _SlotCalls, output: list[int], forced: list[int]) -> None:
        """Run the call the new output closes, if any, and force its result."""
        if forced:  # tokens queued ahead of the output (fast-forward off): search once they are in it
            return
        settings = calls.settings
        text = self.tokenizer.decode(output[calls.scanned:])
        end = text.find(settings.tool_call_end)
        if end < 0:
            return
        opened = text.rfind(settings.tool_call_start, 0, end)
        if opened < 0:  # a stray end marker: not a call, look past it next time
            calls.scanned = len(output)
            return
        if _RESULTS_START in text[end:]:  # answered before the request was preempted
            calls.scanned = self._answered(output)
            return
        call = text[opened + len(settings.tool_call_start):end]
        result = self.tokenizer.encode(f"{_RESULTS_START}{self._run(call, settings.tool_timeout)}{_RESULTS_END}")
        forced.extend(result)
        calls.scanned = len(output) + len(result)

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
