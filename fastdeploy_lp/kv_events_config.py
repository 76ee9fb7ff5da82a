"""`KVEventsConfig`: whether and where the engine publishes its KV-cache events (docs/distributed.md).

Given as vLLM's JSON object, with vLLM's field names and defaults (`vllm/config/kv_events.py`):
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'` or `LLM(kv_events_config={...})`.
Request routers (vllm-router `--policy kv_aware`, NVIDIA Dynamo, llm-d) read the events to send a
request to the replica that holds its prefix. Every key is checked here, before any weight loads;
an error names the key.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

from fastdeploy_lp.options import json_object

PUBLISHERS = ("null", "zmq")
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig`. `publisher` None means "zmq" when events are enabled, else "null"
    (as vLLM). `endpoint` binds when it holds `*`, `::` or is ipc/inproc, else connects;
    `replay_endpoint` (a ROUTER socket, always bound) resends the last `buffer_steps` batches from
    a sequence number a subscriber asks for; `hwm` is the PUB socket's high-water mark;
    `max_queue_size` the batches waiting for the publisher thread (more are dropped, logged)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events: must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher: unknown publisher {self.publisher!r}; "
                             f"known: {', '.join(PUBLISHERS)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"kv_events_config.{name}: must be a ZMQ endpoint such as tcp://*:5557 "
                                 f"({', '.join(s + '...' for s in ENDPOINT_SCHEMES)}), got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config.{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic: must be a string, got {self.topic!r}")

    @property
    def publishes(self) -> bool:
        """True when the engine publishes events (enabled, and a publisher other than "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_value(cls, value: KVEventsConfig | dict | str | None,
                   enable_prefix_caching: bool) -> KVEventsConfig | None:
        """The config of a JSON string, a dict or a config; None (no events) for None, {} or a config
        that does not publish. Refuses events without prefix caching: the events describe the
        prefix cache's blocks, and with it off no block is ever cached."""
        if value is None:
            return None
        if not isinstance(value, KVEventsConfig):
            value = json_object("kv_events_config", value)
            if not value:
                return None
            known = [f.name for f in fields(cls)]
            unknown = sorted(set(value) - set(known))
            if unknown:
                raise ValueError(f"kv_events_config.{unknown[0]}: unknown key; known: {', '.join(known)}")
            value = cls(**value)
        if not value.publishes:
            return None
        if not enable_prefix_caching:
            raise ValueError("kv_events_config: KV-cache events describe the blocks of the prefix cache, and "
                             "prefix caching is off (--no-enable-prefix-caching / enable_prefix_caching=False); "
                             "turn it on or drop --kv-events-config")
        return value


def parse_kv_events_config(text: str) -> dict[str, Any]:
    """The command line's JSON object, checked (argparse reports the error with the flag)."""
    try:
        KVEventsConfig.from_value(text, enable_prefix_caching=True)  # checked with the other flags later
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return json.loads(text)
