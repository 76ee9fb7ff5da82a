"""A hand-driven `share_inputs` for calling processors directly, as the engine's scheduler would.

`HandBatch` places requests in chosen slots, appends sampled tokens and frees slots, keeping every
field of the documented contract (`fastdeploy_lp.engine.scheduler`) consistent; args are validated
and normalised by a pipeline of the built-ins, as the engine does on admission.
"""

from __future__ import annotations

import os

import numpy as np

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.engine.scheduler import new_share_inputs
from fastdeploy_lp.processors import EngineContext, LogitsProcessorPipeline

BUILTINS = ["LogitBiasLogitsProcessor", "BadWordsLogitsProcessor", "NoRepeatNGramLogitsProcessor",
            "AllowedTokenIdsLogitsProcessor", "ThinkingBudgetLogitsProcessor"]
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")


def context_for(model: str = "qwen3", max_num_seqs: int = 8) -> EngineContext:
    """The engine context of a fixture checkpoint: its config and tokenizer, as an engine builds them."""
    return EngineContext.load(FDConfig.create(os.path.join(FIXTURES, model), max_num_seqs=max_num_seqs, device="cpu"))


class HandBatch:
    def __init__(self, context: EngineContext, num_slots: int | None = None):
        self.fd_config = context.config
        self.share = new_share_inputs(num_slots or self.fd_config.max_num_seqs)
        self._validator = LogitsProcessorPipeline(context, BUILTINS)
        self._count = 0

    def place(self, slot: int, prompt: list[int], args: dict | None = None) -> str:
        s = self.share
        assert s["stop_flags"][slot], f"slot {slot} is busy"
        self._count += 1
        rid = f"req-{self._count}"
        s["stop_flags"][slot] = False
        s["req_ids"][slot] = rid
        s["admission_ids"][slot] = self._count
        s["logits_processors_args"][slot] = self._validator.validate_args(args)
        s["prompt_ids"][slot] = np.asarray(prompt, dtype=np.int64)
        s["prompt_lens"][slot] = len(prompt)
        s["output_ids"][slot] = []
        s["step_idx"][slot] = 0
        s["next_tokens"][slot] = -1
        return rid

    def append(self, slot: int, token: int) -> None:
        s = self.share
        s["output_ids"][slot].append(int(token))
        s["step_idx"][slot] = len(s["output_ids"][slot])
        s["next_tokens"][slot] = int(token)

    def free(self, slot: int) -> None:
        s = self.share
        s["stop_flags"][slot] = True
        s["req_ids"][slot] = None
        s["logits_processors_args"][slot] = self._validator.validate_args(None)
        s["output_ids"][slot] = []

    @property
    def slots(self) -> list[int]:
        return [i for i, f in enumerate(self.share["stop_flags"]) if not f]

    def history(self, slot: int) -> list[int]:
        return [int(t) for t in self.share["prompt_ids"][slot]] + list(self.share["output_ids"][slot])

    def args(self, slot: int):
        return self.share["logits_processors_args"][slot]
