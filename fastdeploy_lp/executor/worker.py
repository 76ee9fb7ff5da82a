"""One tensor-parallel rank: started by `paddle.distributed.spawn` (`run_worker`), or on any node by
`paddle.distributed.launch` running `fastdeploy-lp tp-worker` (`run_launched_worker`, multi-node:
`remote_ranks.py`), it joins Paddle's process group, loads its shard of the model and KV cache, and
runs the forward passes the driver sends.

The conversation with the driver (`tensor_parallel.TensorParallelRunner`) over this rank's pipe or
connection (a launched rank first says ("hello", rank, ranks, host, pid, channel) and is sent its
`WorkerSpec`, or ("refused", reason)):

    rank -> driver   ("ready", num_blocks, weight_bytes)                 or ("error", exception, traceback text)
    driver -> rank   ("forward", feeds, fresh_blocks)
    rank -> driver   ("ok", rows) on rank 0, the logits written to the shared buffer `logits_buffer`
                     (`[max_num_seqs, vocab]` float32), or ("ok", logits) as a numpy array if they
                     do not fit or there is no buffer (launched ranks); ("ok", None) on the others;
                     or ("error", exception, traceback text) -- the rank keeps serving
    driver -> rank   ("stop",)   or the pipe closes (the driver is gone): the rank exits
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import threading
import traceback
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import paddle
import paddle.distributed as dist

from fastdeploy_lp.config import FDConfig
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a rank needs to build its runner: the engine's `FDConfig`, values only (the tokenizer,
    tools and custom backends are in the driver's `EngineContext`, which never leaves it)."""

    fd_config: FDConfig
    logits_buffer: str | None  # name of the driver's shared memory block for rank 0's logits; None: sent
    log_level: int


def _error(e: BaseException) -> tuple:
    """An error message the driver can re-raise: the exception itself if it pickles."""
    text = traceback.format_exc()
    try:
        pickle.dumps(e)
    except Exception:
        e = RuntimeError(f"{type(e).__name__}: {e}")
    return ("error", e, text)


def run_worker(spec: WorkerSpec, conns: list[Connection]) -> None:
    """The rank's whole life; `paddle.distributed.spawn` has set the env vars
    `init_parallel_env()` reads (PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, endpoints, and
    FLAGS_selected_gpus on GPU)."""
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    conn = conns[rank]
    for i, other in enumerate(conns):  # so that a rank's death closes its pipe at the driver's end
        if i != rank:
            other.close()
    _run(spec, rank, conn, spec.fd_config.tensor_parallel_size)


def run_launched_worker(driver: str) -> int:
    """`fastdeploy-lp tp-worker --driver HOST:PORT`, run by `paddle.distributed.launch` on each node
    (which sets the same env vars as spawn, and PADDLE_LOCAL_SIZE: the ranks on this node): connect
    to the driver, take its `WorkerSpec`, serve until it stops us. The exit status: 0 when told to
    stop, 1 when refused, never connected or failed to start (so the launcher reports a failure),
    and the process ends at once when the driver closes the liveness channel (it let go of this
    rank, or is gone), even in the middle of a pass or a collective."""
    from fastdeploy_lp.executor.remote_ranks import connect

    if "PADDLE_TRAINER_ID" not in os.environ:
        logger.error("fastdeploy-lp tp-worker runs under paddle.distributed.launch (docs/distributed.md)")
        return 1
    rank, size = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    try:
        conn, liveness = connect(driver, rank, size)
        spec = conn.recv()
    except AuthenticationError:
        logger.error("rank %d: the driver at %s does not share this rank's FDLP_TP_SECRET", rank, driver)
        return 1
    except (OSError, EOFError, ValueError, TimeoutError) as e:
        logger.error("rank %d: could not join the driver at %s: %s", rank, driver, e)
        return 1
    if isinstance(spec, tuple):  # ("refused", reason)
        logger.error("rank %d: the driver at %s refused this rank: %s", rank, driver, spec[1])
        return 1
    threading.Thread(target=_exit_with_driver, args=(liveness,), name="fastdeploy-lp-tp-liveness", daemon=True).start()
    return 0 if _run(spec, rank, conn, int(os.environ.get("PADDLE_LOCAL_SIZE", "1"))) else 1


def _exit_with_driver(liveness: Connection) -> None:
    """The driver never writes on the liveness channel: readable means it closed it or vanished."""
    try:
        liveness.poll(None)
    except OSError:
        pass
    logger.warning("the driver closed this rank's connection: exiting")
    os._exit(1)


def _run(spec: WorkerSpec, rank: int, conn: Connection, ranks_here: int) -> bool:
    """Start, then serve until stopped; False if the start failed (reported to the driver)."""
    # Ctrl-C in a terminal reaches the whole process group: the driver decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, force=True,  # replaces the root handler `import paddle` adds
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s")
    try:
        runner = _start(spec, rank, ranks_here)
        conn.send(("ready", runner.num_blocks, runner.weight_bytes))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        logger.debug("rank %d failed to start", rank, exc_info=True)
        try:
            conn.send(_error(e))
        except OSError:  # the driver is gone
            pass
        return False
    out = None
    if rank == 0 and spec.logits_buffer is not None:
        shm = SharedMemory(name=spec.logits_buffer)  # mapped until the process exits; the driver unlinks it
        rows, vocab = spec.fd_config.max_num_seqs, spec.fd_config.model_config.vocab_size
        out = np.ndarray((rows, vocab), dtype=np.float32, buffer=shm.buf)
    _serve(runner, conn, rank, out)
    return True


def _start(spec: WorkerSpec, rank: int, ranks_here: int):
    size = spec.fd_config.tensor_parallel_size
    device = spec.fd_config.device
    if device.startswith("gpu"):
        device = f"gpu:{dist.ParallelEnv().device_id}"  # this rank's GPU (the launcher's FLAGS_selected_gpus)
    fd_config = dataclasses.replace(spec.fd_config, device=device)
    if device.startswith("cpu") and fd_config.cpu_threads is None:  # the ranks on this machine share its cores
        fd_config = dataclasses.replace(fd_config, cpu_threads=max(1, len(os.sched_getaffinity(0)) // ranks_here))
    paddle.set_device(device)
    dist.init_parallel_env()
    return ModelRunner(fd_config, shard=TensorShard(rank, size, fixed_order=fd_config.deterministic))


def _serve(runner, conn: Connection, rank: int, out: np.ndarray | None) -> None:
    """Run passes until told to stop; rank 0 answers with the logits, in `out` where they fit."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            return
        if message[0] == "stop":
            return
        _, feeds, fresh = message
        try:  # the driver names each feed's adapter (name, path): this rank's shard of it
            feeds = [f if f.lora is None else dataclasses.replace(f, lora=runner.loras.resolve(*f.lora)) for f in feeds]
            logits = runner.forward(feeds, fresh)
            if rank != 0:
                reply = ("ok", None)
            elif out is not None and logits.shape[0] <= out.shape[0]:
                rows = logits.shape[0]
                out[:rows] = logits.numpy()
                reply = ("ok", rows)
            else:
                reply = ("ok", logits.numpy())
        except Exception as e:  # the driver decides whether the group can go on
            logger.debug("forward pass failed", exc_info=True)  # the driver logs it
            reply = _error(e)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
