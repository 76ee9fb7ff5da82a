"""What a processor is handed each step, and the one thing it hands back.

The engine keeps its per-slot state (`ShareInputs`) to itself. Processors get a *step view* of it:
arrays are read-only views, per-slot lists are tuples of values a processor cannot change
(`output_ids` read-only live views of the requests' lists, `logits_processors_args` read-only
copies, `sampling_params` copies made at admission), and each processor gets its own dict. Popping
a key, overwriting an entry or writing into an array changes nothing the engine or another
processor uses: numpy raises on the write, tuples and the read-only args refuse it, and the dict is
rebuilt for the next processor.

The processor's result is what it appended to its own copy of `forced_tokens`. `ForcedTokens.read`
turns that into a typed result per processor and `ForcedTokens.check` validates it before the
engine takes it: only slots whose request enabled the processor, integer ids inside the vocabulary,
and at most `max_model_len` tokens queued per slot (no request could take more). A processor can
only add to a queue, never rewrite tokens another processor queued.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdeploy_lp.processors.base import LogitsProcessorArgs, ShareInputs


class ReadOnlyArgs(LogitsProcessorArgs):
    """A request's `logits_processors_args` as processors see them: reading works as on
    `LogitsProcessorArgs`, every write raises `TypeError`."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("logits_processors_args are read-only in a logits processor")

    __setitem__ = __delitem__ = __ior__ = _refuse
    pop = popitem = clear = update = setdefault = _refuse

    def __reduce__(self):  # pickle and copy would otherwise rebuild it item by item, through __setitem__
        return type(self), (dict(self),)


class ReadOnlyTokens(Sequence):
    """A read-only live view of a request's token list: it grows as the engine appends, and a
    slice is a copy. `np.asarray` reads it in one copy."""

    __slots__ = ("_items",)

    def __init__(self, items: list[int]):
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self._items, dtype=dtype if dtype is not None else np.int64)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self._items) == list(other)

    def __repr__(self) -> str:
        return repr(self._items)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class StepView:
    """Builds each step's view of the engine's `ShareInputs`. Per-slot copies are made when a
    slot's value changes (a request joins), not every step."""

    _COPIED = ("logits_processors_args", "sampling_params", "output_ids")

    def __init__(self) -> None:
        self._sources: dict[str, list[Any]] = {}   # per field: the engine's values the copies were made of
        self._copies: dict[str, list[Any]] = {}

    def build(self, state: ShareInputs) -> dict[str, Any]:
        """The read-only fields, without `forced_tokens` (each processor gets its own: `for_processor`)."""
        view: dict[str, Any] = {}
        for name, value in state.items():
            if name == "forced_tokens":
                continue
            if isinstance(value, np.ndarray):
                view[name] = _read_only(value)
            elif name in self._COPIED:
                view[name] = self._copied(name, value)
            else:
                view[name] = tuple(value)
        return view

    @staticmethod
    def for_processor(view: dict[str, Any], queues: list[list[int]]) -> dict[str, Any]:
        """One processor's dict: the shared read-only fields and its own copy of the queues."""
        return {**view, "forced_tokens": [list(q) for q in queues]}

    def _copied(self, name: str, values: list[Any]) -> tuple:
        sources = self._sources.setdefault(name, [])
        copies = self._copies.setdefault(name, [])
        if len(sources) != len(values):
            sources[:], copies[:] = [object()] * len(values), [None] * len(values)
        for slot, value in enumerate(values):
            if value is not sources[slot]:  # the engine placed a new value: a request joined or left
                sources[slot], copies[slot] = value, _copy(name, value)
        return tuple(copies)


def _copy(name: str, value: Any) -> Any:
    if name == "output_ids":
        return ReadOnlyTokens(value)
    if name == "logits_processors_args":
        return ReadOnlyArgs(value)
    if value is None:
        return None
    copied = copy.copy(value)  # not clone(): that validates again, and the values were validated
    copied.extra = dict(value.extra)
    return copied


class ForcedTokensError(ValueError):
    """A processor's forced tokens broke the contract; the requests that enabled it fail."""


@dataclass(frozen=True)
class ForcedTokens:
    """One processor's result for one step: the tokens it declares certain to come next, per slot
    (appended after what was queued before it ran)."""

    source: str
    tokens: dict[int, tuple[Any, ...]]

    @classmethod
    def read(cls, source: str, before: list[list[int]], after: Any) -> "ForcedTokens":
        """What a processor appended: `after` is the `forced_tokens` it was handed, `before` the
        queues as they were. Raises `ForcedTokensError` if it did anything but append."""
        if not isinstance(after, list) or len(after) != len(before):
            raise ForcedTokensError(f"forced_tokens must stay a list of {len(before)} lists (one per slot)")
        tokens = {}
        for slot, (old, new) in enumerate(zip(before, after)):
            if new == old:
                continue
            if not isinstance(new, list) or len(new) < len(old) or new[:len(old)] != old:
                raise ForcedTokensError(f"slot {slot}: forced tokens may only be appended, not removed or "
                                        "rewritten")
            tokens[slot] = tuple(new[len(old):])
        return cls(source, tokens)

    def without(self, slots: set[int]) -> "ForcedTokens":
        return ForcedTokens(self.source, {s: t for s, t in self.tokens.items() if s not in slots})

    def check(self, enabled_slots: set[int], vocab_size: int, queued: list[list[int]], limit: int) -> None:
        """Raise `ForcedTokensError` unless every token is an id in `0..vocab_size-1` for a slot in
        `enabled_slots`, and no slot's queue grows past `limit`."""
        for slot, tokens in self.tokens.items():
            if slot not in enabled_slots:
                raise ForcedTokensError(f"slot {slot}: forced tokens for a request that did not enable the processor")
            if len(queued[slot]) + len(tokens) > limit:
                raise ForcedTokensError(f"slot {slot}: more than {limit} forced tokens queued (max_model_len)")
            for token in tokens:
                if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < vocab_size:
                    raise ForcedTokensError(f"slot {slot}: forced token {token!r} is not a token id "
                                            f"(0..{vocab_size - 1})")

    def append_to(self, queues: list[list[int]]) -> None:
        for slot, tokens in self.tokens.items():
            queues[slot].extend(int(t) for t in tokens)
