"""`TensorShard`: which slice of the model one tensor-parallel rank holds, and the collectives that
join the slices (`paddle.distributed` over gloo on CPU, NCCL on GPU).

Megatron-style splits, as fleet's `ColumnParallelLinear` / `RowParallelLinear` /
`VocabParallelEmbedding` do them, applied to this decoder's fused layouts:

- column-parallel (each rank computes some output features; no communication): the fused q/k/v
  projection (by heads) and the fused gate/up projection (by MLP columns, `[gate_shard; up_shard]`);
- row-parallel (each rank holds some input features and computes a partial sum): o_proj and
  down_proj, followed by `all_reduce`; their biases are added once, after it;
- vocabulary-parallel: the embedding (ids outside the rank's rows give zeros, then `all_reduce`)
  and the LM head (each rank scores its rows of the vocabulary, then `all_gather`).

Everything else (norms, q/k norms, RoPE) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.distributed as dist


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size` ranks; the process group is Paddle's default one
    (`paddle.distributed.init_parallel_env()`). `fixed_order` (`--deterministic`): `all_reduce`
    adds the ranks' parts in rank order, whatever the tensor's size."""

    rank: int
    size: int
    fixed_order: bool = False

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.size - 1}")

    def part(self, total: int) -> tuple[int, int]:
        """`[start, end)` of this rank's equal share of `total` rows (heads x head_dim, MLP
        columns, vocabulary); `check_tensor_parallel` made sure `size` divides the counts."""
        if total % self.size:
            raise ValueError(f"{total} does not split into {self.size} equal parts")
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum over the ranks (the partial sums of a row-parallel layer); in place when `x` is
        contiguous and the order is not fixed (`linear.linear`'s few-row CPU path gives a transposed
        view, which is copied).
        With `fixed_order` the parts are gathered and added rank 0 first: a ring all-reduce (gloo's,
        NCCL's) cuts the tensor into chunks by its size and starts each chunk's sum at another rank,
        so from three ranks up an element's sum could change with the number of rows in the pass
        (two parts are added alike in either order)."""
        if not x.is_contiguous():
            x = x.contiguous()
        if self.fixed_order and self.size > 2:
            parts: list[paddle.Tensor] = []
            dist.all_gather(parts, x)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total
        dist.all_reduce(x)
        return x

    def all_gather(self, x: paddle.Tensor, axis: int = -1) -> paddle.Tensor:
        """The ranks' slices side by side along `axis`, in rank order (the LM head's vocabulary)."""
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x)
        return paddle.concat(parts, axis=axis)

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (the KV pool size every rank can hold)."""
        t = paddle.to_tensor([value], dtype="int64")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
