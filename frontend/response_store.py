"""The Responses API's stored responses: the last ones this API process made, by id, bounded in
count and in bytes (the oldest go first). In memory only: lost when the server restarts, and
with ``--api-servers N`` each API process keeps its own."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED = 1024
MAX_STORED_BYTES = 64 << 20
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response as it was returned
    history: list[dict[str, Any]]  # its conversation as chat messages, its output included
    size: int = 0


class ResponseStore:
    """The last responses made here, by id, bounded in count and in bytes (oldest out)."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(self, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        entry = StoredResponse(body, history, len(_JSON.encode([body, history])))
        self._entries[body["id"]] = entry
        self._bytes += entry.size
        while self._entries and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
