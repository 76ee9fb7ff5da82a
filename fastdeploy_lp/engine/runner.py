"""Where the model runner was imported from before it moved to `model/runner.py` (below
`distributed/`, whose ranks run it): `from fastdeploy_lp.engine.runner import ModelRunner,
SequenceFeed` keeps working."""

from fastdeploy_lp.model.runner import MKL_CPU_TYPE, ModelRunner, SequenceFeed, pool_blocks, tune_cpu_math, use_device

__all__ = ["MKL_CPU_TYPE", "ModelRunner", "SequenceFeed", "pool_blocks", "tune_cpu_math", "use_device"]
