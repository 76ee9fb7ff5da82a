"""The engine processes behind `DataParallelEngineClient` (`data_parallel.py`): where each runs
(`engine_placements`: its own cores on CPU, its own GPU), starting them, waiting for them to load,
and stopping them. Each runs `data_parallel_worker.run_engine_process`."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from typing import Any

from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.data_parallel_worker import run_engine_process

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large checkpoint from a slow disk


class DataParallelError(RuntimeError):
    """An engine process died or hung while starting."""


@dataclass(frozen=True)
class Placement:
    """One engine's arguments (its device and thread count set) and the cores it is pinned to."""

    args: EngineArgs
    cores: list[int] | None


def engine_placements(args: EngineArgs, device: str, cores: list[int]) -> list[Placement]:
    """Where each of `args.data_parallel_size` engines runs; a `ValueError` for what cannot work.

    CPU: `cpu_threads` per engine (default: the `cores` split evenly, the rest left to the front
    end), each engine pinned to its own cores when they fit. GPU: engine i on the i-th GPU from
    `device` on."""
    n = args.data_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"data_parallel_size: must be a positive integer, got {n!r}")
    if args.tensor_parallel_size > 1:
        raise ValueError(f"data_parallel_size: {n} engines cannot each split the model "
                         f"(tensor_parallel_size={args.tensor_parallel_size}); use one of the two")
    if args.custom_guided_decoding_backends:
        raise ValueError("data_parallel_size: custom guided-decoding backends hand the engine per-request objects "
                         "that do not cross to an engine process; serve them with data_parallel_size=1")
    def one(**changes: Any) -> EngineArgs:
        return dataclasses.replace(args, data_parallel_size=1, **changes)

    if not device.startswith("cpu"):
        return [Placement(one(device=gpu), None) for gpu in _gpus(device, n)]
    threads = args.cpu_threads or len(cores) // n
    if threads == 0:
        raise ValueError(f"data_parallel_size: {n} engines on {len(cores)} CPU core(s) leave no core per engine; "
                         f"use at most {len(cores)} (or set cpu_threads to share cores)")
    if threads * n > len(cores):
        logger.warning("data_parallel_size=%d x cpu_threads=%d on %d core(s): the engines share cores (not pinned)",
                       n, threads, len(cores))
        return [Placement(one(device=device, cpu_threads=threads), None) for _ in range(n)]
    return [Placement(one(device=device, cpu_threads=threads), cores[i * threads:(i + 1) * threads])
            for i in range(n)]


def _gpus(device: str, n: int) -> list[str]:
    import paddle

    first = int(device.split(":")[1]) if ":" in device else 0
    count = paddle.device.cuda.device_count()
    if first + n > count:
        raise ValueError(f"data_parallel_size: {n} engines from {device!r} need GPUs {first}..{first + n - 1}, "
                         f"but {count} GPU(s) are visible (CUDA_VISIBLE_DEVICES)")
    return [f"gpu:{first + i}" for i in range(n)]


@dataclass(eq=False)
class EngineHandle:
    """One engine process as the front end sees it."""

    rank: int
    process: Any
    conn: Any
    cores: list[int] | None
    info: dict = field(default_factory=dict)       # its "ready" message: pid, weight_bytes, threads
    load: int = 0                                   # unfinished sequences routed to it
    requests: int = 0                               # requests routed to it since start
    stats: dict | None = None                       # its latest report
    counts: tuple[int, int] = (0, 0)                # (running, waiting) as it last said
    dead: str | None = None                         # why it stopped for good
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    @property
    def serving(self) -> bool:
        return self.dead is None and (self.stats is None or self.stats["serving"])

    def reason(self) -> str | None:
        if self.dead is not None:
            return self.dead
        return None if self.serving else self.stats["reason"]


def spawn_engines(placements: list[Placement], options: dict[str, Any]) -> list[EngineHandle]:
    """Start one engine process per placement (spawned: a fresh interpreter, no inherited threads)."""
    context = multiprocessing.get_context("spawn")
    engines = []
    for rank, placement in enumerate(placements):
        ours, theirs = context.Pipe()
        process = context.Process(target=run_engine_process, name=f"fastdeploy-lp-engine-{rank}", daemon=True,
                                  args=(rank, placement.args, theirs, placement.cores, options))
        process.start()
        theirs.close()
        engines.append(EngineHandle(rank, process, ours, placement.cores))
    return engines


def wait_until_ready(engines: list[EngineHandle], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait until each engine has built its engine; if one fails, its error is raised (a `ValueError`
    or `OSError` as `build_engine` raised it; the caller stops the others)."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.info = _wait_ready(engine, deadline)


def _wait_ready(engine: EngineHandle, deadline: float) -> dict:
    ready = wait_for([engine.conn, engine.process.sentinel], max(0.0, deadline - time.monotonic()))
    if engine.conn in ready:
        try:
            kind, payload = engine.conn.recv()
        except (EOFError, OSError):
            kind, payload = "died", None
        if kind == "ready":
            return payload
        if kind == "failed":
            raise payload
    if not ready:
        raise DataParallelError(f"data-parallel engine {engine.rank} did not start within {START_TIMEOUT_S:g} s")
    engine.process.join(5)
    raise DataParallelError(f"data-parallel engine {engine.rank} died while starting: {exit_status(engine.process)}")


def exit_status(process) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def stop_engines(engines: list[EngineHandle], timeout: float) -> None:
    """Ask every engine process to stop, then terminate (and kill) what is left after `timeout`."""
    for engine in engines:
        try:
            engine.send(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + timeout
    for engine in engines:
        engine.process.join(max(0.0, deadline - time.monotonic()))
        if engine.process.is_alive():
            engine.process.terminate()
            engine.process.join(2)
        if engine.process.is_alive():
            engine.process.kill()
            engine.process.join(2)
        engine.conn.close()
