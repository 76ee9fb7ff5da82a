"""The bounded in-memory store behind `store: true`, `previous_response_id` and
GET/DELETE /v1/responses/{id}.

It holds at most `max_entries` responses and at most `max_bytes` of them; adding one past either
bound evicts the least recently used (a GET or a `previous_response_id` counts as a use). Entries are
kept as compact JSON bytes, not as the Python objects they decode to, so the bound measures the memory
they hold: a list of 600,000 empty lists is 1.8 MB of JSON but 40 MB of Python objects. It lives in the server process: a restart forgets everything, and an evicted or deleted id is
a 404 (as a `previous_response_id`, a 400 naming that field).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_RESPONSES_STORE_SIZE = 1000       # responses kept (--responses-store-size)
DEFAULT_RESPONSES_STORE_BYTES = 256 << 20  # and at most this many bytes of them (--responses-store-bytes)
_ENTRY_OVERHEAD = 512  # bytes an entry holds beyond its JSON: the dataclass, two bytes objects, the index


@dataclass(frozen=True)
class StoredResponse:
    response_json: bytes      # the response object, as POST answered it
    conversation_json: bytes  # its input items (earlier turns' included) and its output items

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self.response_json)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.conversation_json)

    @property
    def size(self) -> int:
        return len(self.response_json) + len(self.conversation_json) + _ENTRY_OVERHEAD


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_RESPONSES_STORE_SIZE,
                 max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("responses store: the bounds must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # handlers run on the event loop, but tests and tools may not

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep `response`, evicting the least recently used ones past the bounds. One larger than
        `max_bytes` on its own is not kept."""
        entry = StoredResponse(_compact(response), _compact(conversation))
        with self._lock:
            self._remove(response["id"])
            if entry.size > self.max_bytes or self.max_entries == 0:
                return
            self._entries[response["id"]] = entry
            self._bytes += entry.size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._remove(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None


def _compact(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
