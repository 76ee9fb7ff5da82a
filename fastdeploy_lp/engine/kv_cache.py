"""The KV cache's block pool: fixed-size blocks, reference counts, and the prefix cache.

Every layer's cache is one tensor of `num_blocks` blocks of `block_size` positions (runner.py); a
request owns a *block table*, the list of its blocks in position order. This module only does the
bookkeeping, on the host:

- **Allocation by use.** A request holds blocks for the tokens it has, not for `max_model_len`.
  Block 0 is the null block: always zero, never handed out, it pads block tables so a batch's
  tables have one length (padded positions are masked, and zeros keep masked scores finite).
- **Prefix caching.** A full block is keyed by a hash of every token up to and including it, so
  equal keys mean equal keys *and* values in every layer. A request that starts with cached blocks
  shares them (reference counts) and skips computing them. A block whose count drops to zero keeps
  its contents and stays findable until the pool needs room: then the least recently used goes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

NULL_BLOCK = 0


def block_hashes(tokens: list[int], block_size: int, parent: bytes = b"", start: int = 0) -> list[bytes]:
    """Chained hashes of the full blocks of `tokens[start:]`, each covering every token before it.

    `parent` is the hash of the block ending at `start` (b"" at the start). SHA-256, not Python's
    hash(): a collision would hand one request another's cache, and tokens are user input.
    """
    out = []
    for begin in range(start, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + np.asarray(tokens[begin:begin + block_size], dtype=np.int64).tobytes()).digest()
        out.append(parent)
    return out


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0      # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class BlockPool:
    """Free blocks, reference counts and the hash → block map of the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcounts = np.zeros(num_blocks, dtype=np.int64)
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._cached: dict[bytes, int] = {}               # hash -> block, for full blocks
        self._hash_of: dict[int, bytes] = {}               # block -> its hash, while cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        self.fresh: list[int] = []  # handed out since the runner last zeroed them
        self.stats = PrefixCacheStats()
        self.events = None  # a KVEventLog (engine/kv_events.py) while KV-cache events are published

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: never used, or cached with no holder."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def lookup(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """The longest run of cached blocks matching `hashes`, at most `max_blocks`, each now held."""
        found = []
        if self.enable_prefix_caching:
            for h in hashes[:max_blocks]:
                block = self._cached.get(h)
                if block is None:
                    break
                found.append(block)
        for block in found:
            self._hold(block)
        return found

    def record_lookup(self, queried: int, hit: int) -> None:
        self.stats.queried_tokens += queried
        self.stats.hit_tokens += hit

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, or None (and nothing taken) when fewer than `n` are free."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached block nobody holds
                block, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of.pop(block)
                del self._cached[block_hash]
                if self.events is not None:
                    self.events.removed(block_hash)
            self.refcounts[block] = 1
            out.append(block)
        self.fresh.extend(out)
        return out

    def _hold(self, block: int) -> None:
        if self.refcounts[block] == 0:
            self._evictable.pop(block, None)
        self.refcounts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; cached ones stay findable, the rest become free.

        Released last block first, so a prefix's tail is evicted before its head (which more
        requests are likely to share)."""
        for block in reversed(blocks):
            self.refcounts[block] -= 1
            assert self.refcounts[block] >= 0, f"block {block} released more often than held"
            if self.refcounts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def register(self, block: int, block_hash: bytes) -> bool:
        """Make a full block findable by its hash (a block already cached under it wins); True when
        it became findable now."""
        if self.enable_prefix_caching and block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash
            return True
        return False

    def take_fresh(self) -> list[int]:
        fresh, self.fresh = self.fresh, []
        return fresh

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (they become plain free blocks). The KV events
        say AllBlocksCleared when no cached block is left, else which blocks went."""
        forgotten = []
        for block in list(self._evictable):
            forgotten.append(self._hash_of.pop(block))
            del self._cached[forgotten[-1]]
            self._free.append(block)
        self._evictable.clear()
        if self.events is not None and self._cached:  # held blocks stay cached: name the ones that went
            for block_hash in forgotten:
                self.events.removed(block_hash)
        elif self.events is not None:
            self.events.cleared()
