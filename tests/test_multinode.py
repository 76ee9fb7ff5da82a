"""Multi-node tensor parallelism (docs/distributed.md): the driver waits at `tensor_parallel_address`
for ranks that `paddle.distributed.launch` starts on each "node" (two launches on this host with
their own --rank, as two machines would run them), and answers as one process does; strangers and
misfits at the address are turned away; a rank that dies fails the engine and the launches end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import numpy as np
import pytest
from conftest import fixture_dir
from server_harness import free_port

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.executor import remote_ranks, worker

SECRET = "test-secret-0123456789"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def _launch(node: int, master: int, driver: str, log_dir: Path) -> subprocess.Popen:
    """One "machine": Paddle's launcher with one rank, running `fastdeploy-lp tp-worker`."""
    cli = Path(sys.executable).with_name("fastdeploy-lp")
    env = dict(os.environ, FDLP_TP_SECRET=SECRET, GLOG_minloglevel="2")
    return subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--rank", str(node),
                             "--master", f"127.0.0.1:{master}", "--nproc_per_node", "1", "--job_id", "fdlp-test",
                             "--log_dir", str(log_dir / f"node{node}"), str(cli), "tp-worker", "--driver", driver],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _strangers(address: tuple[str, int], seen: dict) -> None:
    """While the driver waits for its ranks: a client that connects and says nothing, and one with
    another secret. Neither may delay the ranks."""
    deadline = time.monotonic() + 60
    while "silent" not in seen and time.monotonic() < deadline:
        try:
            seen["silent"] = socket.create_connection(address, timeout=5)
        except OSError:
            time.sleep(0.2)
    try:
        Client(address, authkey=b"not the secret").close()
        seen["wrong secret"] = None
    except Exception as e:  # noqa: BLE001 - which error is what the test reads
        seen["wrong secret"] = type(e)


def _answers(llm: LLM):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs.token_ids, np.array([lp.logprob for lp in o.outputs.logprobs])) for o in outs]


def test_two_launched_nodes_answer_as_one_process_and_a_lost_rank_fails_the_engine(tmp_path, monkeypatch):
    reference = _answers(LLM(fixture_dir("llama"), device="cpu", max_num_seqs=2))
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("FDLP_TP_SECRET", SECRET)
    master = free_port()
    nodes = [_launch(node, master, address, tmp_path) for node in (0, 1)]
    try:
        strangers: dict = {}
        threading.Thread(target=_strangers, args=(remote_ranks.parse_address(address), strangers)).start()
        llm = LLM(fixture_dir("llama"), device="cpu", max_num_seqs=2, tensor_parallel_size=2,
                  tensor_parallel_address=address)
        for (tokens, logprobs), (want_tokens, want_logprobs) in zip(_answers(llm), reference):
            assert tokens == want_tokens
            np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-4)
        pids = llm.engine.runner.worker_pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pids[1]}\) on \S+ closed its connection"):
            _answers(llm)
        for node in nodes:  # rank 0 is let go by the driver and exits at once; each launcher ends with its rank
            node.wait(60)
        assert strangers["wrong secret"] in (AuthenticationError, EOFError, ConnectionResetError)
        strangers["silent"].close()
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


# -- what the address refuses (no rank process is started) ------------------------------------------
def test_start_up_refuses_a_missing_secret_a_bad_address_and_one_rank(monkeypatch):
    monkeypatch.delenv("FDLP_TP_SECRET", raising=False)
    with pytest.raises(ValueError, match="FDLP_TP_SECRET"):
        LLM(fixture_dir("llama"), device="cpu", tensor_parallel_size=2, tensor_parallel_address="127.0.0.1:29999")
    monkeypatch.setenv("FDLP_TP_SECRET", SECRET)
    with pytest.raises(ValueError, match="tensor_parallel_address: expected HOST:PORT"):
        LLM(fixture_dir("llama"), device="cpu", tensor_parallel_size=2, tensor_parallel_address="no-port")
    with pytest.raises(ValueError, match="tensor_parallel_address.*2 or more"):
        LLM(fixture_dir("llama"), device="cpu", tensor_parallel_address="127.0.0.1:29999")


def test_a_rank_of_another_group_is_refused_and_the_driver_names_the_ranks_it_waited_for(monkeypatch):
    monkeypatch.setenv("FDLP_TP_SECRET", SECRET)
    address = f"127.0.0.1:{free_port()}"
    result = {}

    def driver():
        try:
            remote_ranks.accept_ranks(address, 2, time.monotonic() + 4)
        except TimeoutError as e:
            result["error"] = str(e)

    thread = threading.Thread(target=driver)
    thread.start()
    passes, liveness = remote_ranks.connect(address, 0, 3)  # a launch of three ranks
    reply = passes.recv()
    assert reply[0] == "refused" and "group of 3 ranks" in reply[1] and "tensor_parallel_size=2" in reply[1]
    thread.join(10)
    assert "rank(s) 0, 1 of 2 did not connect" in result["error"]
    passes.close()
    liveness.close()
    with pytest.raises(TimeoutError):  # the port was let go: not "Address already in use"
        remote_ranks.accept_ranks(address, 2, time.monotonic() + 0.5)


def test_a_relaunched_rank_replaces_its_dead_connections_and_silent_peers_are_dropped(monkeypatch):
    monkeypatch.setenv("FDLP_TP_SECRET", SECRET)
    monkeypatch.setattr(remote_ranks, "GREETING_TIMEOUT_S", 1.0)
    address = f"127.0.0.1:{free_port()}"
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        ranks=remote_ranks.accept_ranks(address, 2, time.monotonic() + 20)))
    thread.start()
    first = remote_ranks.connect(address, 0, 2)
    silent = socket.create_connection(remote_ranks.parse_address(address))  # never answers the challenge
    time.sleep(0.5)
    for conn in first:  # rank 0's first launch dies before the group forms
        conn.close()
    ranks = [remote_ranks.connect(address, 0, 2), remote_ranks.connect(address, 1, 2)]  # relaunched
    thread.join(20)
    conns, remote = result["ranks"]
    assert [r.rank for r in remote] == [0, 1] and all(r.is_alive() for r in remote)
    time.sleep(1.5)
    assert not [t for t in threading.enumerate() if t.name == "fastdeploy-lp-tp-greet"]  # the silent one too
    for conn in [*conns, *(c for pair in ranks for c in pair)]:
        conn.close()
    silent.close()


def test_a_rank_that_dies_after_joining_is_not_counted_when_the_last_rank_comes(monkeypatch):
    monkeypatch.setenv("FDLP_TP_SECRET", SECRET)
    address = f"127.0.0.1:{free_port()}"
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        ranks=remote_ranks.accept_ranks(address, 2, time.monotonic() + 20)))
    thread.start()
    for conn in remote_ranks.connect(address, 0, 2):  # joins, then dies with no relaunch yet
        time.sleep(0.2)
        conn.close()
    rank_1 = remote_ranks.connect(address, 1, 2)
    time.sleep(0.5)
    assert thread.is_alive()  # still waiting for rank 0
    rank_0 = remote_ranks.connect(address, 0, 2)
    thread.join(20)
    conns, remote = result["ranks"]
    assert [r.rank for r in remote] == [0, 1] and all(r.is_alive() for r in remote)
    for conn in [*conns, *rank_0, *rank_1]:
        conn.close()


def test_tp_worker_outside_the_launcher_says_so(monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINER_ID", raising=False)
    assert worker.run_launched_worker("127.0.0.1:1") == 1
