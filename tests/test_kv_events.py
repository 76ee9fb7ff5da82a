"""KV-cache events (`--kv-events-config`): vLLM's config, checked at start-up; the blocks the prefix
cache stores, evicts and forgets, published over a real ZMQ PUB socket in vLLM's wire format and
read back here with a plain SUB socket and `msgpack.unpackb` (not the module's own code); replay
of missed batches over the ROUTER socket. The engine is the built-in default model on CPU."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.engine.kv_cache import BlockPool, block_hashes
from fastdeploy_lp.engine.kv_events import KVEventLog, KVEventPublisher
from fastdeploy_lp.entrypoints.openai.args import make_parser
from fastdeploy_lp.kv_events_config import KVEventsConfig

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
LOCAL = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0",
         "topic": "kv-events"}


def low64(block_hash: bytes) -> int:
    """vLLM's integer block hash, written out here independently: the digest's last 8 bytes."""
    return int.from_bytes(block_hash[-8:], "big")


def local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


class Subscriber:
    """What a router does: a SUB socket on the topic; each message (topic, seq, payload)."""

    def __init__(self, endpoint: str, topic: bytes = b"kv-events"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(local(endpoint))
        time.sleep(0.3)  # PUB/SUB: the subscription reaches the publisher asynchronously

    def receive(self, timeout_ms: int = 2000) -> list[tuple[bytes, int, bytes]]:
        got = []
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            got.append((topic, int.from_bytes(seq, "big"), payload))
            timeout_ms = 300
        return got

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def events_of(messages) -> list[dict]:
    return [event for _, _, payload in messages for event in msgpack.unpackb(payload)[1]]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(block_size=BLOCK, num_blocks=12, max_num_seqs=2, device="cpu", kv_events_config=LOCAL)
    yield llm
    llm.engine.kv_events.shutdown()


@pytest.fixture
def sub(llm):
    llm.engine.reset_prefix_cache()
    s = Subscriber(llm.engine.kv_events.endpoint)
    s.receive(300)  # the reset's batch
    yield s
    s.close()


# -- the config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, message", [
    ("{not json", "kv_events_config: not valid JSON"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kv_events_config.publisher: unknown publisher 'kafka'"),
    ({"enable_kv_cache_events": True, "endpoint": None}, "kv_events_config.endpoint: must be a ZMQ endpoint"),
    ({"enable_kv_cache_events": True, "endpoint": ""}, "kv_events_config.endpoint: must be a ZMQ endpoint"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "localhost:5558"}, "kv_events_config.replay_endpoint"),
    ({"enable_kv_cache_events": True, "hwm": 0}, "kv_events_config.hwm: must be a positive integer"),
    ({"enable_kv_cache_events": True, "endpiont": "tcp://*:5557"}, "kv_events_config.endpiont: unknown key"),
])
def test_a_bad_config_is_refused_at_start_up_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
        EngineArgs(device="cpu", kv_events_config=value).create_engine_config()


def test_events_without_prefix_caching_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="kv_events_config: .*prefix caching is off"):
        EngineArgs(device="cpu", enable_prefix_caching=False,
                   kv_events_config={"enable_kv_cache_events": True}).create_engine_config()


def test_the_config_takes_vllms_fields_and_defaults():
    config = EngineArgs(device="cpu", kv_events_config='{"enable_kv_cache_events": true, "topic": "kv-events", '
                        '"buffer_steps": 7, "hwm": 9}').create_engine_config().kv_events_config
    assert (config.publisher, config.endpoint, config.replay_endpoint) == ("zmq", "tcp://*:5557", None)
    assert (config.topic, config.buffer_steps, config.hwm, config.max_queue_size) == ("kv-events", 7, 9, 100_000)
    # Disabled, or the null publisher: no events, as vLLM.
    assert KVEventsConfig.from_value({"enable_kv_cache_events": False}, enable_prefix_caching=False) is None
    assert KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "null"}, True) is None


def test_the_server_flag_checks_the_json(capsys):
    parser = make_parser()
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000"}'])
    assert args.kv_events_config == {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "kafka"}'])
    assert "--kv-events-config" in capsys.readouterr().err


def test_an_endpoint_in_use_is_a_start_up_error_naming_the_field():
    first = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"))
    try:
        taken = first.endpoint.replace("0.0.0.0", "*")
        with pytest.raises(ValueError, match="kv_events_config.endpoint: cannot open"):
            KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=taken))
    finally:
        first.shutdown()


# -- the wire format ------------------------------------------------------------------------------
def test_the_payload_is_vllms_event_batch_byte_for_byte_in_its_layout(llm, sub):
    prompt = list(range(100, 109))  # two full blocks and one token
    llm.generate([prompt], GREEDY, use_tqdm=False)
    messages = sub.receive()
    topic, seq, payload = messages[0]
    assert topic == b"kv-events"
    # [ts, events, data_parallel_rank]: a fixarray of 3, ts a float64, events a list, rank 0 last.
    assert payload[0] == 0x93 and payload[1] == 0xCB and payload[-1] == 0x00
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    stored = events[0]
    # A tagged map: "type" first, then vLLM's fields in its declaration order, defaults left out.
    assert payload.index(b"\xa4type") < payload.index(b"\xacblock_hashes")
    assert list(stored) == STORED_KEYS
    hashes = block_hashes(prompt, BLOCK)
    assert stored == {"type": "BlockStored", "block_hashes": [low64(h) for h in hashes], "parent_block_hash": None,
                      "token_ids": prompt[:8], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                      "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}
    assert [m[1] for m in messages] == sorted(m[1] for m in messages)  # one sequence, counting up


def test_shared_prefix_prompts_store_only_their_new_blocks_chained_to_the_shared_ones(llm, sub):
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    first, second = shared + [20, 21, 22, 23, 24], shared + [30, 31, 32, 33, 34]
    llm.generate([first], GREEDY, use_tqdm=False)
    llm.generate([second], GREEDY, use_tqdm=False)
    stored = [e for e in events_of(sub.receive()) if e["type"] == "BlockStored"]
    h1, h2 = block_hashes(first, BLOCK), block_hashes(second, BLOCK)
    assert h1[:2] == h2[:2]
    assert stored[0]["block_hashes"] == [low64(h) for h in h1] and stored[0]["token_ids"] == first[:12]
    # The second prompt found the two shared blocks cached: only its third block is new, its parent
    # the shared prefix's last block.
    again = [e for e in stored[1:] if low64(h2[2]) in e["block_hashes"]]
    assert len(again) == 1 and again[0]["block_hashes"][0] == low64(h2[2])
    assert again[0]["parent_block_hash"] == low64(h2[1]) and again[0]["token_ids"][:4] == second[8:12]
    assert not any(low64(h2[0]) in e["block_hashes"] for e in stored[1:])


def test_evicting_cached_blocks_for_new_ones_publishes_block_removed(llm, sub):
    old = list(range(200, 221))  # 5 full blocks of the pool's 11
    llm.generate([old], GREEDY, use_tqdm=False)
    llm.generate([list(range(300, 329))], GREEDY, use_tqdm=False)  # 8 blocks: the pool must evict
    events = events_of(sub.receive())
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert all(list(e) == ["type", "block_hashes", "medium", "group_idx"] and e["medium"] == "GPU"
               for e in events if e["type"] == "BlockRemoved")
    stored_old = [low64(h) for h in block_hashes(old, BLOCK)]
    assert removed and set(removed) <= set(stored_old + [h for e in events if e["type"] == "BlockStored"
                                                         for h in e["block_hashes"]])
    assert removed[0] == stored_old[-1]  # least recently used first: the prefix's tail before its head


def test_reset_prefix_cache_publishes_all_blocks_cleared(llm, sub):
    llm.generate([list(range(400, 410))], GREEDY, use_tqdm=False)
    llm.reset_prefix_cache()
    events = events_of(sub.receive())
    assert events[-1] == {"type": "AllBlocksCleared"}
    assert llm.engine.block_pool.lookup(block_hashes(list(range(400, 410)), BLOCK), 2) == []


def test_a_late_subscriber_gets_the_missed_batches_from_the_replay_socket(llm, sub):
    llm.generate([list(range(500, 513))], GREEDY, use_tqdm=False)
    llm.generate([list(range(600, 613))], GREEDY, use_tqdm=False)
    live = sub.receive()
    start = live[1][1]
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(local(llm.engine.kv_events.replay_endpoint))
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = []
        while dealer.poll(2000):
            empty, topic, seq, payload = dealer.recv_multipart()  # the live message's frames after b""
            assert (empty, topic) == (b"", b"kv-events")
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed[:len(live) - 1] == [(s, p) for _, s, p in live[1:]]
        assert [s for s, _ in replayed] == list(range(start, start + len(replayed)))
    finally:
        dealer.close(linger=0)
        ctx.term()


# -- the block pool's log (no sockets) ---------------------------------------------------------------
def test_a_reset_that_leaves_held_blocks_cached_names_the_blocks_it_forgot():
    pool = BlockPool(6, block_size=2, enable_prefix_caching=True)
    pool.events = KVEventLog(2)
    a, b = block_hashes([1, 2, 3, 4], 2)
    held, unheld = pool.allocate(2)
    pool.register(held, a)
    pool.register(unheld, b)
    pool.release([unheld])
    pool.reset_prefix_cache()
    assert pool.events.take() == [{"type": "BlockRemoved", "block_hashes": [low64(b)], "medium": "GPU",
                                   "group_idx": 0}]


def test_a_full_queue_drops_the_batch_instead_of_waiting():
    publisher = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", max_queue_size=1))
    sending = threading.Event()

    def slow(events):  # a socket that does not drain: the thread sits in one send
        sending.set()
        time.sleep(1.0)
    publisher._send = slow
    try:
        publisher.publish([{"type": "AllBlocksCleared"}])   # taken by the thread, which is now stuck
        assert sending.wait(2)
        started = time.perf_counter()
        publisher.publish([{"type": "AllBlocksCleared"}])   # fills the queue of 1
        publisher.publish([{"type": "AllBlocksCleared"}])   # dropped, not waited for
        assert time.perf_counter() - started < 0.1 and publisher.dropped == 1
        publisher.publish([])                                # a step without events sends nothing
        assert publisher.dropped == 1
    finally:
        publisher.shutdown()


def test_a_failing_publisher_never_reaches_the_step(llm, sub, monkeypatch):
    def broken(events):
        raise OSError("socket gone")
    monkeypatch.setattr(llm.engine.kv_events, "_send", broken)
    out = llm.generate([list(range(700, 710))], GREEDY, use_tqdm=False)
    assert len(out[0].outputs.token_ids) == 2
