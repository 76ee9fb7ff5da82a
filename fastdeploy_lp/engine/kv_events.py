"""KV-cache events in vLLM's wire format, published over ZMQ for KV-aware request routers.

With `--kv-events-config` (`kv_events_config.py`) the block pool records, during a step, which
full blocks became findable in the prefix cache (`BlockStored`), which were evicted or forgotten
(`BlockRemoved`) and when everything unheld was forgotten at once (`AllBlocksCleared`); after the
step the engine hands them to `KVEventPublisher.publish` as one batch. A daemon thread encodes and
sends the batch, so the step never waits on a socket and nothing here raises into it.

The bytes are what vLLM's `ZmqEventPublisher` sends (vllm/distributed/kv_events.py, since vLLM
PR #42892 which dropped `array_like` from the events; vLLM 0.26 and later):

- a ZMQ multipart message `(topic, seq, payload)`: `seq` an 8-byte big-endian counter from 0;
- `payload` a msgpack array `[ts, events, data_parallel_rank]` (`EventBatch`, `array_like`);
- each event a msgpack map whose first key is `"type"` (msgspec's `tag=True`), then the fields in
  vLLM's declaration order, those left at their default omitted (`omit_defaults=True`):
  `BlockStored` {type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, kv_cache_spec_kind}, `BlockRemoved` {type, block_hashes,
  medium, group_idx}, `AllBlocksCleared` {type}.

Block hashes go out as vLLM's default integer form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): the
low 64 bits of the engine's SHA-256 block hash, an unsigned msgpack integer. vllm-router 0.1.17
decodes an int or bytes hash alike (it keys its index by its own hash of `token_ids`), and older
consumers (Dynamo, llm-d before bytes support) read only ints.

A replay ROUTER socket (`replay_endpoint`) answers a request `[identity, b"", start_seq]` with
`[identity, b"", topic, seq, payload]` for each buffered batch from `start_seq` on, then
`[identity, b"", topic, -1 (8 bytes, signed), b""]`: a DEALER reads the live message's frames after
its empty delimiter. The topic frame is vLLM's since PR #45177; vllm-router 0.1.17 reads the
sequence number as the second frame from the end and drops a replay answer without it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from fastdeploy_lp.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV cache (the device tier), whatever the device
KV_CACHE_SPEC_KIND = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SHUTDOWN_TIMEOUT_S = 1.0


def external_hash(block_hash: bytes) -> int:
    """vLLM's `maybe_convert_block_hash` with integer hashes on: the digest's low 64 bits."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> dict[str, Any]:
    """A `BlockStored` event as vLLM's encoder writes it (no LoRA, no extra keys: one None per block)."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": MEDIUM_GPU,
            "lora_name": None, "extra_keys": [None] * len(hashes), "group_idx": 0,
            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND}


def block_removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": MEDIUM_GPU, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """One `EventBatch` payload: the msgpack array `[ts, events, data_parallel_rank]`."""
    import msgpack

    return msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)


class KVEventLog:
    """The events of the step under way, recorded by the `BlockPool` (`pool.events`).

    Blocks stored one after the other in a chain (each the parent of the next) join one
    `BlockStored`, as vLLM sends one per newly cached run of a request."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.events: list[dict[str, Any]] = []

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: list[int]) -> None:
        h, p = external_hash(block_hash), None if parent is None else external_hash(parent)
        last = self.events[-1] if self.events else None
        if last is not None and last["type"] == "BlockStored" and p is not None and last["block_hashes"][-1] == p:
            last["block_hashes"].append(h)
            last["token_ids"].extend(token_ids)
            last["extra_keys"].append(None)
        else:
            self.events.append(block_stored([h], p, token_ids, self.block_size))

    def removed(self, block_hash: bytes) -> None:
        self.events.append(block_removed([external_hash(block_hash)]))

    def cleared(self) -> None:
        self.events.append(all_blocks_cleared())

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's: rank r of a data-parallel group publishes on the endpoint's port + r (inproc: a suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """vLLM's `ZmqEventPublisher`: a PUB socket, an optional replay ROUTER socket with the last
    `buffer_steps` batches, and one daemon thread (`kv-events-publisher`) that owns both sockets
    after start-up. `publish` only queues; a full queue drops the batch (logged) rather than wait.

    Start-up errors (an address in use, a bad endpoint) raise `ValueError` naming the field."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0  # batches dropped because the queue was full
        self._queue: queue.Queue[list | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._stop = threading.Event()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._open(zmq.PUB, "endpoint", config.endpoint, config.hwm)
            if config.replay_endpoint is not None:
                self._replay = self._open(zmq.ROUTER, "replay_endpoint", config.replay_endpoint, None)
        except BaseException:
            self._close_sockets()
            raise
        # Where the sockets are (the port the system chose for tcp://*:0), read before the thread owns them.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def _open(self, kind: int, field: str, endpoint: str, hwm: int | None):
        zmq = self._zmq
        endpoint = offset_endpoint_port(endpoint, self.data_parallel_rank)
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            sock.set_hwm(hwm)
        try:
            if kind == zmq.ROUTER or _binds(endpoint):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ValueError(f"kv_events_config.{field}: cannot open {endpoint!r}: {e}") from None
        return sock

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one step's events as a batch (nothing for no events). Never blocks, never raises."""
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: the publisher's queue is full (%d batches); %d batches dropped",
                               self.config.max_queue_size, self.dropped)
        except Exception:  # noqa: BLE001 - the step loop must never see the publisher fail
            logger.exception("KV events: could not queue a batch")

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            if self._replay is not None:
                self._serve_replays()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            try:
                self._send(events)
            except Exception:  # noqa: BLE001 - keep publishing the next batches
                logger.exception("KV events: could not publish a batch")
                time.sleep(0.1)
        self._close_sockets()

    def _send(self, events: list[dict[str, Any]]) -> None:
        payload = encode_batch(time.time(), events, self.data_parallel_rank)
        seq, self._seq = self._seq, self._seq + 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the buffered batches from its sequence number on."""
        try:
            while self._replay.poll(0):
                frames = self._replay.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events: a replay request of %d frames, not 3; ignored", len(frames))
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", self._topic, END_SEQ, b""))
        except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
            logger.exception("KV events: replay failed")

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def shutdown(self) -> None:
        """Publish what is queued (for up to a second), then close the sockets."""
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wakes the thread; with a full queue it stops once it drains
        except queue.Full:
            pass
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV events: %d batches left unpublished at shutdown", self._queue.qsize())
