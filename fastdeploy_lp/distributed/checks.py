"""Start-up checks for `tensor_parallel_size` (and `tensor_parallel_address`), run by `EngineArgs.create_engine_config` (which
`LLM()`, the server and `FDConfig.create` go through) before any weight loads."""

from __future__ import annotations

import logging
import os
import sys
from typing import Protocol

from fastdeploy_lp import envs

logger = logging.getLogger(__name__)


class SplitCounts(Protocol):
    """What the check reads of a `ModelConfig`: the counts every rank must get an equal share of
    (a protocol, not `ModelConfig` itself: config.py imports this module to run the check)."""

    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    intermediate_size: int


def check_tensor_parallel(model_config: SplitCounts, device: str, size, launched: bool = False) -> None:
    """Refuse, with a `ValueError` naming `tensor_parallel_size`, a size the model cannot be split
    into (heads, KV heads, MLP columns and vocabulary must divide evenly), or that this machine or
    Paddle build cannot run: more ranks than GPUs, no NCCL (GPU) or gloo (CPU) in the build, a
    platform without Paddle's process groups. On CPU, more ranks than cores is allowed (the ranks
    share the cores: slower, same results) with a warning. `launched`: the ranks run on other
    machines (`tensor_parallel_address`), whose GPUs and cores this one cannot count."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer, got {size!r}")
    if size == 1:
        return
    counts = {"num_attention_heads": model_config.num_attention_heads,
              "num_key_value_heads": model_config.num_key_value_heads,
              "vocab_size": model_config.vocab_size,
              "intermediate_size": model_config.intermediate_size}
    uneven = [f"{name}={value}" for name, value in counts.items() if value % size]
    if uneven:
        fits = [n for n in range(2, size * 2 + 1) if all(v % n == 0 for v in counts.values())]
        hint = f" (sizes that fit: {', '.join(map(str, fits[:6]))})" if fits else ""
        raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {', '.join(uneven)}; every "
                         f"rank must get an equal share of the heads, KV heads, MLP columns and vocabulary{hint}")
    if not sys.platform.startswith("linux"):
        raise ValueError(f"tensor_parallel_size: {size} needs Linux (Paddle's gloo/NCCL process groups); "
                         f"this is {sys.platform}")

    import paddle
    from paddle.base import core

    if not paddle.is_compiled_with_distribute():
        raise ValueError(f"tensor_parallel_size: {size} needs a PaddlePaddle build with distributed support "
                         f"(paddle.distributed); this one has none")
    kind = device.split(":")[0]
    if kind == "gpu":
        if not core.is_compiled_with_cuda():
            raise ValueError(f"tensor_parallel_size: {size} on device {device!r} needs the CUDA build of "
                             f"PaddlePaddle (paddlepaddle-gpu); this one is CPU-only (use device='cpu' for gloo)")
        if not core.is_compiled_with_nccl():
            raise ValueError(f"tensor_parallel_size: {size} on GPUs needs NCCL, which this PaddlePaddle build "
                             f"was not compiled with")
        first = int(device.split(":")[1]) if ":" in device else 0
        count = paddle.device.cuda.device_count()
        if first + size > count and not launched:
            raise ValueError(f"tensor_parallel_size: {size} ranks starting at {device!r} need GPUs {first}.."
                             f"{first + size - 1}, but {count} GPU(s) are visible (CUDA_VISIBLE_DEVICES)")
    elif kind == "cpu":
        if not hasattr(core, "ProcessGroupGloo"):
            raise ValueError(f"tensor_parallel_size: {size} on CPU needs gloo, which this PaddlePaddle build "
                             f"was not compiled with")
        cores = len(os.sched_getaffinity(0))
        if size > cores and not launched:
            logger.warning("tensor_parallel_size=%d on %d CPU core(s): the ranks share cores, so this is slower "
                           "than tensor_parallel_size=1 (results are the same)", size, cores)
    else:
        raise ValueError(f"tensor_parallel_size: {size} runs on 'cpu' (gloo) or 'gpu' (NCCL), not on {device!r}")


def check_launched_ranks(address: str, size: int) -> None:
    """Refuse a `tensor_parallel_address` the driver could not wait at (no secret, not HOST:PORT, or
    no ranks to wait for), with a `ValueError` naming it."""
    if size < 2:
        raise ValueError("tensor_parallel_address: the ranks it waits for are tensor-parallel ranks; set "
                         "tensor_parallel_size to their number (2 or more)")
    parse_address(address)
    secret()


def parse_address(text: str, what: str = "tensor_parallel_address") -> tuple[str, int]:
    """`HOST:PORT` as a `(host, port)` pair; a `ValueError` naming `what` otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{what}: expected HOST:PORT (e.g. 10.0.0.1:29600), got {text!r}")
    return host, int(port)


def secret() -> bytes:
    """The shared secret of the driver and its launched ranks; a `ValueError` when it is unset."""
    value = envs.get("FDLP_TP_SECRET")
    if not value:
        raise ValueError("tensor_parallel_address: set FDLP_TP_SECRET to the same secret in the driver's and every "
                         "rank's environment (the ranks and the driver exchange pickles, so each side proves it "
                         "knows the secret first)")
    return value.encode()
