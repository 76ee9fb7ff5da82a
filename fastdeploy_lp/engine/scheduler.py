"""`SlotScheduler`: a waiting queue, `max_num_seqs` slots, and the `share_inputs` that mirror them.

`share_inputs` is the per-slot contract processors read (docs/logits_processors.md). Every field
has one entry per slot; `stop_flags[i]` is True when slot i is free or its request has finished.

| field                    | type                           | meaning                                      |
|--------------------------|--------------------------------|----------------------------------------------|
| stop_flags               | np.ndarray[bool] [slots]       | True = slot not running                      |
| req_ids                  | list[str or None]              | request id in the slot                       |
| logits_processors_args   | list[LogitsProcessorArgs]      | the request's args (empty when none)         |
| prompt_ids               | list[np.ndarray[int64]]        | prompt token ids                             |
| prompt_lens              | np.ndarray[int64] [slots]      | prompt lengths                               |
| output_ids               | list[list[int]]                | tokens generated so far (live list)          |
| step_idx                 | np.ndarray[int64] [slots]      | number of tokens generated so far            |
| next_tokens              | np.ndarray[int64] [slots]      | last sampled token (-1 before the first)     |
| sampling_params          | list[SamplingParams or None]   | the request's full sampling parameters       |
| admission_ids            | np.ndarray[int64] [slots]      | a number no other admission ever gets: tells a request that joined a slot from the one before it |
| forced_tokens            | list[list[int]]                | written by processors in `update_state`: tokens certain to come next (see below) |
| temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, presence_penalty |
|                          | np.ndarray [slots]             | the request's sampling fields                |

`forced_tokens` is the one field processors write. Tokens a processor appends to
`forced_tokens[slot]` during `update_state` are appended to that request's output before its next
sampled token: all at once in this step when fast-forward is on (one forward pass over them, like
a small prefill), one per step otherwise, so the output is the same either way. A processor treats
them as already generated when it publishes them; they then show up in `output_ids`.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..processors.base import LogitsProcessorArgs
from .request import Request

SHARE_INPUTS_VERSION = 1
_SAMPLING_FIELDS = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int64, "min_p": np.float32,
                    "repetition_penalty": np.float32, "frequency_penalty": np.float32,
                    "presence_penalty": np.float32}


def new_share_inputs(max_num_seqs: int) -> dict:
    s = max_num_seqs
    inputs = {
        "stop_flags": np.ones(s, dtype=bool),
        "req_ids": [None] * s,
        "logits_processors_args": [LogitsProcessorArgs() for _ in range(s)],
        "prompt_ids": [np.zeros(0, dtype=np.int64) for _ in range(s)],
        "prompt_lens": np.zeros(s, dtype=np.int64),
        "output_ids": [[] for _ in range(s)],
        "step_idx": np.zeros(s, dtype=np.int64),
        "next_tokens": np.full(s, -1, dtype=np.int64),
        "sampling_params": [None] * s,
        "admission_ids": np.full(s, -1, dtype=np.int64),
        "forced_tokens": [[] for _ in range(s)],
    }
    for name, dtype in _SAMPLING_FIELDS.items():
        inputs[name] = np.zeros(s, dtype=dtype)
    return inputs


class SlotScheduler:
    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * max_num_seqs
        self.share_inputs = new_share_inputs(max_num_seqs)
        self._admissions = 0

    @property
    def running(self) -> list[Request]:
        """Requests in slots, in increasing slot order (the row order of the logits)."""
        return [r for r in self.slots if r is not None]

    def admit(self) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Move waiting requests into free slots, lowest slot first.

        Returns (admitted, rejected): a request whose values cannot be stored in its slot is
        rejected with the error and leaves the slot free; the others are unaffected.
        """
        admitted, rejected = [], []
        for slot in range(self.max_num_seqs):
            while self.slots[slot] is None and self.waiting:
                request = self.waiting.popleft()
                try:
                    self._place(request, slot)
                    admitted.append(request)
                except Exception as e:
                    self.free(request)
                    rejected.append((request, e))
        return admitted, rejected

    def _place(self, request: Request, slot: int) -> None:
        request.slot = slot
        self.slots[slot] = request
        s, p = self.share_inputs, request.params
        s["stop_flags"][slot] = False
        s["req_ids"][slot] = request.request_id
        s["logits_processors_args"][slot] = request.args
        s["prompt_ids"][slot] = np.asarray(request.prompt_ids, dtype=np.int64)
        s["prompt_lens"][slot] = len(request.prompt_ids)
        s["output_ids"][slot] = request.output_ids
        s["step_idx"][slot] = 0
        s["next_tokens"][slot] = -1
        s["sampling_params"][slot] = p
        self._admissions += 1
        s["admission_ids"][slot] = self._admissions
        s["forced_tokens"][slot] = []
        for name in _SAMPLING_FIELDS:
            s[name][slot] = getattr(p, name)

    def record_token(self, request: Request, token: int) -> None:
        s = self.share_inputs
        s["step_idx"][request.slot] = len(request.output_ids)
        s["next_tokens"][request.slot] = token

    def free(self, request: Request) -> None:
        slot = request.slot
        if slot is None or self.slots[slot] is not request:
            return
        self.slots[slot] = None
        s = self.share_inputs
        s["stop_flags"][slot] = True
        s["req_ids"][slot] = None
        s["logits_processors_args"][slot] = LogitsProcessorArgs()
        s["sampling_params"][slot] = None
        s["output_ids"][slot] = []
