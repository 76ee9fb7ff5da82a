"""The rank driver: a `ModelRunner` spread over `tensor_parallel_size` processes
(docs/distributed.md).

`tensor_parallel.TensorParallelRunner` is the engine's runner when the model is split: it starts
one process per rank (`worker.run_worker`), each holding a `ModelRunner` over its shard of the
weights, and drives their forward passes. The primitives the model itself uses to be split (the
shard and its collectives, the start-up checks) are in `fastdeploy_lp.distributed`, below the
model; this package is above it, as vLLM's executors are above `vllm.distributed`.
"""
