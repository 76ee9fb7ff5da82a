"""`draft_share_inputs`: the processors' `share_inputs` as of one draft depth of a verify pass.

At depth d a slot with at least d drafts is active, and its history is what plain decoding would
show at that position: its output followed by its first d drafts (`output_ids`, `step_idx`,
`next_tokens`). Slots without a draft that deep are shown stopped, so a processor sees one row per
slot at each depth, in slot order, exactly as in a plain step (docs/speculative_decoding.md).
"""

from __future__ import annotations

import numpy as np

from fastdeploy_lp.processors.base import ShareInputs


def draft_share_inputs(share_inputs: ShareInputs, drafts: dict[int, list[int]], depth: int) -> ShareInputs:
    """A copy of `share_inputs` at draft `depth` (>= 1); the engine's own is left as it is."""
    slots = [slot for slot, tokens in drafts.items() if len(tokens) >= depth]
    stop_flags = np.ones_like(share_inputs["stop_flags"])
    stop_flags[slots] = False
    output_ids = list(share_inputs["output_ids"])
    step_idx, next_tokens = share_inputs["step_idx"].copy(), share_inputs["next_tokens"].copy()
    for slot in slots:
        output_ids[slot] = list(output_ids[slot]) + list(drafts[slot][:depth])
        step_idx[slot], next_tokens[slot] = len(output_ids[slot]), drafts[slot][depth - 1]
    return {**share_inputs, "stop_flags": stop_flags, "output_ids": output_ids, "step_idx": step_idx,
            "next_tokens": next_tokens, "forced_tokens": [[] for _ in output_ids]}
