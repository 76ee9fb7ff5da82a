"""Tensor parallelism on Paddle's distributed stack (docs/distributed.md).

`TensorShard` is the slice of the model one rank holds and the collectives that join the slices;
`check_tensor_parallel` refuses, before any weight loads, a size the model or the machine cannot
run. The runner that starts the ranks (`runner.TensorParallelRunner`) and the rank's own loop
(`worker.run_worker`) are not imported here: they run the model's runner (`model.runner`), and the
model imports `shard` from this package, so importing them here would close an import cycle.
"""

from fastdeploy_lp.distributed.checks import check_tensor_parallel
from fastdeploy_lp.distributed.shard import TensorShard

__all__ = ["TensorShard", "check_tensor_parallel"]
