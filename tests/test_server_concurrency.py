"""Many clients at once: 32 concurrent streams with different args share the batch and each gets
its own result; a client that disconnects frees its slot; slow steps never block the event loop."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from fastdeploy_lp.tokenizer import Tokenizer
from server_harness import QWEN2, start_server

CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server():
    s = start_server("--max-num-seqs", "32", "--logits-processors", "LogitBiasLogitsProcessor",
                     "server_processors:ForceTokenLogitsProcessor", "server_processors:SlowLogitsProcessor")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokens() -> tuple[Tokenizer, list[int]]:
    """Token ids whose text repeats cleanly (printable, no byte fragments)."""
    tok = Tokenizer(QWEN2)
    ok = [t for t in range(100, tok.vocab_size) if tok.decode([t]).strip() and tok.decode([t]).isascii()
          and tok.decode([t]).isprintable()
          and tok.decode([t] * 3) == tok.decode([t]) * 3]
    return tok, ok


def wait_until_idle(server, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = server.metric("fastdeploy_lp:num_requests_running")
        if running == 0:
            return running
        time.sleep(0.05)
    return server.metric("fastdeploy_lp:num_requests_running")


def check_leaving_aborts(server, open_stream, give_up, timeout_error: type[Exception]) -> None:
    """For the SDK endpoints: `open_stream()` is an SDK stream (a context manager) of a long request,
    `give_up()` the same request unstreamed under a short read timeout. Leaving the stream after six
    events (text deltas among them), and the timeout, each abort the request: the slot frees and one
    more request ends as abort."""
    aborted = server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"')
    with open_stream() as stream:
        for seen, _ in enumerate(stream):
            if seen == 5:
                break
        assert server.metric("fastdeploy_lp:num_requests_running") == 1
    # leaving the block closes the connection mid-stream
    assert wait_until_idle(server) == 0
    with pytest.raises(timeout_error):
        give_up()
    assert wait_until_idle(server) == 0
    assert server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"') == aborted + 2


def test_32_concurrent_streaming_clients_each_get_their_own_result(server, tokens):
    tok, candidates = tokens
    picks = candidates[:: max(1, len(candidates) // 32)][:32]
    assert len(picks) == 32

    async def one(client, i):
        token, max_tokens = picks[i], 6 + i % 5
        args = {"slow_ms": 5}
        common = dict(model="default", max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                      temperature=[0.0, 0.7, 1.3][i % 3], seed=i)
        if i % 2 == 0:  # chat, forced by the custom FQCN processor
            args["force_token"] = token
            stream = await client.chat.completions.create(messages=CHAT, extra_body={"logits_processors_args": args},
                                                          **common)
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        else:  # completions, forced by a +100 logit bias
            args["logit_bias"] = {str(token): 100.0}
            stream = await client.completions.create(prompt=f"Client {i} says", **common,
                                                     extra_body={"logits_processors_args": args})
            pieces = []
            async for c in stream:
                if c.choices:
                    pieces.append(c.choices[0].text)
                else:
                    usage = c.usage
            assert usage.completion_tokens == max_tokens
        return "".join(pieces), tok.decode([token] * max_tokens)

    async def sample_running(stop: asyncio.Event, seen: list[float]):
        async with httpx.AsyncClient(timeout=10) as h:
            while not stop.is_set():
                text = (await h.get(server.url("/metrics"))).text
                line = next(x for x in text.splitlines() if x.startswith("fastdeploy_lp:num_requests_running "))
                seen.append(float(line.split()[1]))
                await asyncio.sleep(0.02)

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
        stop, seen = asyncio.Event(), []
        sampler = asyncio.ensure_future(sample_running(stop, seen))
        try:
            results = await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            stop.set()
            await sampler
            await client.close()
        return results, seen

    results, seen = asyncio.run(main())
    for i, (got, want) in enumerate(results):
        assert got == want, f"client {i}"
    assert max(seen) >= 8, f"requests did not share the batch: running counts seen {sorted(set(seen))}"
    assert wait_until_idle(server) == 0


def test_client_disconnect_mid_stream_frees_the_slot(server):
    aborted = server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"')
    body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "logits_processors_args": {"slow_ms": 20}}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url("/v1/chat/completions"), json=body) as r:
            lines, seen = r.iter_lines(), 0
            while seen < 3:
                seen += next(lines).startswith("data: ")
            assert server.metric("fastdeploy_lp:num_requests_running") == 1
        # leaving the block closes the connection mid-stream
    assert wait_until_idle(server) == 0
    assert server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"') == aborted + 1


def test_client_that_gives_up_on_a_non_streaming_request_frees_the_slot(server):
    aborted = server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"')
    body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "logits_processors_args": {"slow_ms": 20}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/chat/completions"), json=body, timeout=httpx.Timeout(10, read=0.5))
    assert wait_until_idle(server) == 0
    assert server.metric("fastdeploy_lp:request_finished_total", 'finish_reason="abort"') == aborted + 1


def test_slow_steps_do_not_block_the_event_loop(server):
    """Each step of this request takes 600 ms; /health still answers at once meanwhile."""
    body = {"messages": CHAT, "max_tokens": 3, "ignore_eos": True, "logits_processors_args": {"slow_ms": 600}}

    async def main():
        async with httpx.AsyncClient(timeout=30) as h:
            slow = asyncio.ensure_future(h.post(server.url("/v1/chat/completions"), json=body))
            await asyncio.sleep(0.3)
            latencies = []
            for _ in range(4):
                start = time.monotonic()
                assert (await h.get(server.url("/health"))).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.1)
            response = await slow
            return latencies, response

    latencies, response = asyncio.run(main())
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    assert max(latencies) < 0.4, latencies
