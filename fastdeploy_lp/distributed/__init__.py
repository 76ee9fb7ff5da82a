"""Tensor parallelism's primitives on Paddle's distributed stack (docs/distributed.md), below the
model that uses them.

`TensorShard` is the slice of the model one rank holds and the collectives that join the slices;
`check_tensor_parallel` refuses, before any weight loads, a size the model or the machine cannot
run. The ranks are started and driven from `fastdeploy_lp.executor`, above the model.
"""

from fastdeploy_lp.distributed.checks import check_tensor_parallel
from fastdeploy_lp.distributed.shard import TensorShard

__all__ = ["TensorShard", "check_tensor_parallel"]
