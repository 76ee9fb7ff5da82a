"""`TokenHistory`: each slot's prompt + output token ids, kept in step with `share_inputs`.

Processors that look back at the text (bad words, n-gram bans, thinking budget) need each row's
history. Rebuilding it from `prompt_ids` and `output_ids` every step costs a pass over every
prompt; this keeps it in one `[slots, capacity]` array instead and updates it incrementally:

* a slot whose request changed (or that advanced by more than one token) is copied once;
* a running slot that advanced by one token gets `next_tokens[slot]` written at its end, all such
  slots in one vectorized write (and one small upload for the device mirror).

`update` is idempotent within a step, so the engine may call `update_state` again after failing
requests. Positions at or beyond `lengths[slot]` hold stale values; readers mask them.
"""

from __future__ import annotations

import numpy as np
import paddle


class TokenHistory:
    def __init__(self, capacity: int = 256, device: bool = False):
        self.capacity = max(int(capacity), 16)  # grows (doubling) with the longest history seen
        self.device = device
        self.ids: np.ndarray | None = None        # [slots, capacity] int64, host
        self.tensor: paddle.Tensor | None = None  # the same on the default Paddle device (device=True)
        self.lengths = np.zeros(0, dtype=np.int64)
        self._owner: list = []
        self._generated = np.zeros(0, dtype=np.int64)

    def update(self, share_inputs: dict, slots: np.ndarray) -> None:
        """Bring the rows of `slots` up to date with `share_inputs`."""
        if self.ids is None or self.ids.shape[0] != len(share_inputs["stop_flags"]):
            self._allocate(len(share_inputs["stop_flags"]))
        if len(slots) == 0:
            return
        admissions, step = share_inputs["admission_ids"], share_inputs["step_idx"]
        fresh = [s for s in slots if self._owner[s] != admissions[s]]
        fresh_mask = np.isin(slots, fresh)
        grew = step[slots] - self._generated[slots]
        fresh += [s for s in slots[~fresh_mask & (grew != 0) & (grew != 1)]]
        for s in fresh:
            self._copy(share_inputs, s)
        one = slots[~np.isin(slots, fresh) & (grew == 1)]
        if len(one):
            pos = share_inputs["prompt_lens"][one] + step[one] - 1
            self._reserve(int(pos.max()) + 1)
            tokens = share_inputs["next_tokens"][one]
            self.ids[one, pos] = tokens
            self.lengths[one] = pos + 1
            self._generated[one] = step[one]
            if self.device:
                both = paddle.to_tensor(np.stack([one, pos, tokens]).astype(np.int64))
                self.tensor.index_put_((both[0], both[1]), both[2])

    def tails(self, slots: np.ndarray, k: int) -> np.ndarray:
        """`[len(slots), k]`: the last k ids of each slot's history, -1 where the history is shorter."""
        pos = self.lengths[slots, None] - k + np.arange(k)
        out = self.ids[slots[:, None], np.maximum(pos, 0)]
        out[pos < 0] = -1
        return out

    # -- internals --------------------------------------------------------------------------------
    def _allocate(self, num_slots: int) -> None:
        self.ids = np.full((num_slots, self.capacity), -1, dtype=np.int64)
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self._owner = [None] * num_slots
        self._generated = np.zeros(num_slots, dtype=np.int64)
        if self.device:
            self.tensor = paddle.to_tensor(self.ids)

    def _reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        self.capacity = max(length, 2 * self.capacity)
        grown = np.full((self.ids.shape[0], self.capacity), -1, dtype=np.int64)
        grown[:, : self.ids.shape[1]] = self.ids
        self.ids = grown
        if self.device:
            self.tensor = paddle.to_tensor(self.ids)

    def _copy(self, share_inputs: dict, slot: int) -> None:
        prompt, output = share_inputs["prompt_ids"][slot], share_inputs["output_ids"][slot]
        row = np.concatenate([np.asarray(prompt, dtype=np.int64), np.asarray(output, dtype=np.int64)])
        self._reserve(len(row))
        self.ids[slot, : len(row)] = row
        self.lengths[slot] = len(row)
        self._owner[slot] = int(share_inputs["admission_ids"][slot])
        self._generated[slot] = len(output)
        if self.device:
            self.tensor[slot, : len(row)] = paddle.to_tensor(row)
