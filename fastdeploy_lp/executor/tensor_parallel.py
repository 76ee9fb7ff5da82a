"""`TensorParallelRunner`: the engine's model runner when the model is split over several processes.

The engine process is the driver and holds no weights: its scheduler, block pool, processor
pipeline and sampler are the single-process ones. `tensor_parallel_size` ranks, started with
`paddle.distributed.spawn` (gloo on CPU, NCCL on GPU), or on several machines with
`paddle.distributed.launch` when `tensor_parallel_address` is set (`remote_ranks.py`), each hold a
shard of the model and their KV heads' slice of the paged cache (`worker.py`). Each pass the driver sends every rank the
same feeds over its pipe; the ranks run the pass together (all-reduces after o_proj and down_proj,
an all-gather of the LM head's vocabulary slices) and rank 0 writes the full `[rows, vocab]`
logits into a shared memory block (one copy, no pickling; launched ranks send them), from which
they are copied to the engine's device, so processors see exactly what one process gives them.

A rank that dies never hangs the driver: the driver waits on the ranks' pipes *and* their process
sentinels (a launched rank's liveness connection), and a watcher thread notices a death between passes. Either way the runner records
`failure`, stops the other ranks, tells the `on_failure` callbacks (the server exits) and every
later `forward` raises `TensorParallelError`.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import warnings
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import paddle

from fastdeploy_lp import envs
from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.executor.remote_ranks import RemoteRank, accept_ranks
from fastdeploy_lp.executor.worker import WorkerSpec, run_worker
from fastdeploy_lp.model.lora import LoRAManager
from fastdeploy_lp.model.runner import SequenceFeed, use_device

logger = logging.getLogger(__name__)

START_TIMEOUT_S = envs.get_float("FDLP_TP_START_TIMEOUT")  # spawn + load, all ranks
ERROR_GRACE_S = 10.0  # after one rank reports an error, how long the others may take to report too
STOP_TIMEOUT_S = 5.0  # a rank asked to stop gets this long before it is killed


class TensorParallelError(RuntimeError):
    """The tensor-parallel ranks can no longer run passes (one died or hung); the message says which."""


def _spawn_options(device: str, size: int) -> dict:
    """`paddle.distributed.spawn` options: gloo on CPU; NCCL on GPU with ranks on the `size` visible
    GPUs starting at the engine's device (`gpu:k` -> GPUs k..k+size-1)."""
    if not device.startswith("gpu"):
        return {"backend": "gloo"}
    first = int(device.split(":")[1]) if ":" in device else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [d.strip() for d in visible.split(",") if d.strip()] or \
        [str(i) for i in range(paddle.device.cuda.device_count())]
    return {"backend": "nccl", "gpus": ",".join(ids[first:first + size])}


def _describe_exit(process) -> str:
    if isinstance(process, RemoteRank):
        return process.describe_exit()
    # Its sentinel fired. Another thread (the watcher, or the pass) may be reaping it right now, and
    # then this thread's waitpid finds nothing: wait until the status shows.
    deadline = time.monotonic() + 2.0
    while process.exitcode is None and time.monotonic() < deadline:
        process.join(0.05)
    code = process.exitcode
    if code is None:
        return "stopped (exit status unknown)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Ranks:
    """The rank processes (or `RemoteRank`s) and their pipes; `stop` may run from any thread, at
    exit, or when the runner is collected (it must not refer to the runner)."""

    def __init__(self, processes: list, conns: list[Connection], logits: SharedMemory | None, context=None):
        self.context = context  # spawn's MultiprocessContext: its queues must outlive the start
        self.processes = processes
        self.conns = conns
        self.logits = logits  # rank 0 writes the logits here; unlinked when the ranks are gone
        self.unlinked = logits is None
        self.stopping = threading.Event()
        self._lock = threading.Lock()

    def stop(self, graceful: bool = True) -> None:
        """Ask every rank to exit and kill those still there after `STOP_TIMEOUT_S`; not `graceful`
        (the group is broken, the survivors may be stuck in a collective): kill them at once."""
        with self._lock:
            if self.stopping.is_set() and not any(p.is_alive() for p in self.processes):
                return
            self.stopping.set()
            if graceful:
                for conn in self.conns:
                    try:
                        conn.send(("stop",))
                    except (OSError, ValueError):
                        pass
                deadline = time.monotonic() + STOP_TIMEOUT_S
                for p in self.processes:
                    p.join(max(0.0, deadline - time.monotonic()))
            for p in self.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
            for conn in self.conns:
                conn.close()
            if not self.unlinked:
                self.unlinked = True
                self.logits.unlink()
                try:
                    self.logits.close()
                except BufferError:  # a pass is copying from it (close() during a pass): left to the GC
                    pass


class _GroupBroken(Exception):
    """A rank died, or did not answer in time: the group cannot run another pass."""

    def __init__(self, message: str, errors: list[tuple[int, tuple]]):
        super().__init__(message)
        self.errors = errors


class TensorParallelRunner:
    """Drop-in for `ModelRunner` (`num_blocks`, `block_size`, `weight_bytes`, `loras`, `forward`) over
    `tensor_parallel_size` rank processes. `close()` stops them (also at exit and when the runner is
    collected). `loras` checks and names the adapters here; a pass sends each rank its rows' adapters
    by name and path, and each rank holds its own shard of them (`LoRAManager.resolve`)."""

    def __init__(self, fd_config: FDConfig):
        use_device(fd_config)  # the logits, processors and sampler live on the engine's device
        self.size = fd_config.tensor_parallel_size
        self.block_size = fd_config.cache_config.block_size
        self.vocab_size = fd_config.model_config.vocab_size
        self.failure: str | None = None
        self._callbacks = []
        self._fail_lock = threading.Lock()
        lora_config = fd_config.lora_config
        self.loras = None if lora_config is None else LoRAManager(fd_config.model_config, lora_config)
        started = time.monotonic()
        backend = _spawn_options(fd_config.device, self.size)["backend"]
        self._ranks = self._start_ranks(fd_config, started + START_TIMEOUT_S)
        weakref.finalize(self, self._ranks.stop)  # also runs at interpreter exit
        try:
            replies = self._collect("start", started + START_TIMEOUT_S)
        except _GroupBroken as e:
            self._ranks.stop(graceful=False)  # the others may wait for the failed one in init_parallel_env
            if e.errors:  # the first rank's own error (a bad checkpoint, no memory) says more than the hang
                raise self._start_error(*e.errors[0]) from None
            if fd_config.tensor_parallel_address is not None:
                raise TensorParallelError(f"{e} (its log says why: paddle.distributed.launch's --log_dir on its "
                                          f"machine)") from None
            raise TensorParallelError(f"{e} (its output above says why; note that the ranks are started with "
                                      f"multiprocessing's spawn, which re-imports the main script: a script "
                                      f"that builds the engine at import time needs "
                                      f"`if __name__ == \"__main__\":`)") from None
        errors = [(rank, r) for rank, r in enumerate(replies) if r[0] == "error"]
        if errors:
            self._ranks.stop(graceful=False)
            raise self._start_error(*errors[0])
        self.num_blocks = min(r[1] for r in replies)
        self.weight_bytes = sum(r[2] for r in replies)  # every rank's shard
        where = ", ".join(f"{p.host}:{p.pid}" if isinstance(p, RemoteRank) else str(p.pid)
                          for p in self._ranks.processes)
        logger.info("tensor parallel: %d ranks over %s (pids %s) ready in %.1fs; %d KV cache blocks per rank",
                    self.size, backend, where, time.monotonic() - started, self.num_blocks)
        threading.Thread(target=_watch, args=(weakref.ref(self), self._ranks), name="fastdeploy-lp-tp-watch",
                         daemon=True).start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._ranks.processes]

    def _start_ranks(self, fd_config: FDConfig, deadline: float) -> _Ranks:
        """Spawn the ranks here, or wait for the launched ones to connect; either way send each its
        `WorkerSpec`."""
        log_level = logging.getLogger().getEffectiveLevel()
        if fd_config.tensor_parallel_address is not None:
            conns, ranks = accept_ranks(fd_config.tensor_parallel_address, self.size, deadline)
            spec = pickle.dumps(WorkerSpec(fd_config, None, log_level), protocol=pickle.HIGHEST_PROTOCOL)
            remote = _Ranks(ranks, conns, None)
            try:
                for conn in conns:
                    conn.send_bytes(spec)
            except OSError as e:
                remote.stop(graceful=False)
                raise TensorParallelError(f"a tensor-parallel rank left before it was sent the model: {e}") from None
            return remote
        shm = SharedMemory(create=True, size=fd_config.max_num_seqs * self.vocab_size * 4)
        try:
            return self._spawn(WorkerSpec(fd_config, shm.name, log_level), fd_config.device, shm)
        except BaseException:
            shm.unlink()
            shm.close()
            raise

    def _spawn(self, spec: WorkerSpec, device: str, shm: SharedMemory) -> _Ranks:
        pipes = [multiprocessing.Pipe() for _ in range(self.size)]
        options = _spawn_options(device, self.size)
        quiet = {"GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "1")}  # no INFO lines of the TCP store
        saved = {k: os.environ.get(k) for k in quiet}
        os.environ.update(quiet)
        try:
            with warnings.catch_warnings():  # spawn warns that gloo means "CPUONLY mode"
                warnings.simplefilter("ignore")
                context = paddle.distributed.spawn(run_worker, args=(spec, [child for _, child in pipes]),
                                                   nprocs=self.size, join=False, daemon=True, **options)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for _, child in pipes:
            child.close()
        return _Ranks(context.processes, [parent for parent, _ in pipes], shm, context)

    @staticmethod
    def _start_error(rank: int, reply: tuple) -> BaseException:
        _, error, text = reply
        logger.debug("tensor-parallel rank %d failed to start:\n%s", rank, text)
        return error

    # -- the engine's interface -----------------------------------------------------------------
    def forward(self, feeds: list[SequenceFeed], fresh_blocks: list[int] = ()) -> paddle.Tensor:
        """The same contract as `ModelRunner.forward`: `[feeds asking for logits, vocab]` float32 on
        the engine's device, in the feeds' order."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self._ranks.stopping.is_set():
            raise TensorParallelError("the tensor-parallel runner was closed")
        feeds = [f if f.lora is None else dataclasses.replace(f, lora=(f.lora.name, f.lora.path)) for f in feeds]
        message = pickle.dumps(("forward", feeds, list(fresh_blocks)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank, conn in enumerate(self._ranks.conns):
                self._send(rank, conn, message, "forward pass")
            replies = self._collect("forward pass", None)
        except _GroupBroken as e:
            if self.failure is None and self._ranks.stopping.is_set():  # close() ran meanwhile
                raise TensorParallelError("the tensor-parallel runner was closed") from None
            self._fail(str(e))
            raise TensorParallelError(self.failure) from None
        errors = [(rank, r) for rank, r in enumerate(replies) if r[0] == "error"]
        if errors:  # every rank answered, so the group is in step: this pass fails, the next may run
            rank, (_, error, text) = errors[0]
            logger.error("tensor-parallel rank %d failed the forward pass:\n%s", rank, text)
            raise RuntimeError(f"tensor-parallel rank {rank}: {type(error).__name__}: {error}") from error
        logits = replies[0][1]
        if isinstance(logits, int):  # rows of the shared buffer, copied out before the next pass writes it
            logits = np.ndarray((logits, self.vocab_size), dtype=np.float32, buffer=self._ranks.logits.buf)
        return paddle.to_tensor(logits) if logits.shape[0] else paddle.zeros([0, self.vocab_size], "float32")

    def on_failure(self, callback) -> None:
        """`callback(message)` runs once (on a helper thread) if the ranks can no longer serve."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def close(self) -> None:
        """Stop every rank (asked first, killed after `STOP_TIMEOUT_S`)."""
        self._ranks.stop()

    # -- waiting on the ranks -------------------------------------------------------------------
    def _send(self, rank: int, conn: Connection, message: bytes, what: str) -> None:
        """A dead rank's pipe breaks before its exit status shows: report the death, not the pipe."""
        try:
            conn.send_bytes(message)
        except OSError as e:
            process = self._ranks.processes[rank]
            process.join(5)
            if process.is_alive():
                raise _GroupBroken(f"tensor-parallel rank {rank}'s pipe broke before the {what}: {e}", []) from None
            raise _GroupBroken(f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process)} "
                               f"before the {what}", []) from None

    def _collect(self, what: str, deadline: float | None) -> list[tuple]:
        """One reply per rank, in rank order. Raises `_GroupBroken` if a rank dies, if `deadline`
        passes, or if a rank has not answered `ERROR_GRACE_S` after another reported an error (it is
        stuck in a collective the failed rank never joined)."""
        ranks = self._ranks
        pending = dict(enumerate(ranks.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(ranks.processes)}
        replies: dict[int, tuple] = {}
        errors: list[tuple[int, tuple]] = []
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending.values()) + list(sentinels), timeout)
            if not ready:
                late = ", ".join(map(str, sorted(pending)))
                why = f"after {_error_text(*errors[0])}" if errors else "in time"
                raise _GroupBroken(f"tensor-parallel rank(s) {late} did not finish the {what} {why}", errors)
            for rank in [r for r, c in pending.items() if c in ready]:
                try:
                    replies[rank] = reply = pending[rank].recv()
                except (EOFError, OSError):  # the rank is gone: its sentinel fires now or soon
                    ranks.processes[rank].join(5)
                    ready.append(ranks.processes[rank].sentinel)
                    del pending[rank]
                    continue
                del pending[rank]
                if reply[0] == "error":
                    errors.append((rank, reply))
                    if deadline is None or deadline > time.monotonic() + ERROR_GRACE_S:
                        deadline = time.monotonic() + ERROR_GRACE_S
            dead = sorted(sentinels[s] for s in ready if s in sentinels)
            if dead:
                rank, process = dead[0], ranks.processes[dead[0]]
                if ranks.stopping.is_set():
                    raise _GroupBroken(self.failure or "the tensor-parallel ranks were stopped", errors)
                detail = f"; {_error_text(*errors[0])}" if errors else ""
                raise _GroupBroken(f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process)} "
                                   f"during the {what}{detail}", errors)
        return [replies[r] for r in range(self.size)]

    def _fail(self, message: str) -> None:
        """Record why the group is done (the first reason wins), stop every rank, tell the callbacks."""
        with self._fail_lock:
            if self.failure is not None:
                return
            self.failure = message + "; the engine cannot run the model any more"
        logger.error("%s", self.failure)
        threading.Thread(target=self._after_failure, name="fastdeploy-lp-tp-stop", daemon=True).start()

    def _after_failure(self) -> None:
        self._ranks.stop(graceful=False)
        for callback in list(self._callbacks):
            try:
                callback(self.failure)
            except Exception:
                logger.exception("tensor-parallel failure callback failed")


def _error_text(rank: int, reply: tuple) -> str:
    return f"rank {rank} failed with {type(reply[1]).__name__}: {reply[1]}"


def _watch(runner_ref: "weakref.ref[TensorParallelRunner]", ranks: _Ranks) -> None:
    """Between passes nobody waits on the ranks: notice a death here, so that a server without
    traffic still stops at once. Holds no reference to the runner while it waits."""
    sentinels = {p.sentinel: rank for rank, p in enumerate(ranks.processes)}
    ready = wait(list(sentinels))
    runner = runner_ref()
    if ranks.stopping.is_set() or runner is None:
        return
    rank = min(sentinels[s] for s in ready)
    process = ranks.processes[rank]
    runner._fail(f"tensor-parallel rank {rank} (pid {process.pid}) {_describe_exit(process)}")
