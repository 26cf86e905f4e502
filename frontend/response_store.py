"""The Responses API's stored responses: the last ones this API process made, by id, bounded in
count and in bytes (the oldest go first). In memory only: lost when the server restarts, and
with ``--api-servers N`` each API process keeps its own.

A response continued with ``previous_response_id`` stores its conversation as the earlier one's
message objects plus its own, so a chain of turns holds each message once: the bytes bound
counts each distinct message once (while any stored response holds it), and each body."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_STORED = 1024
MAX_STORED_BYTES = 64 << 20
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response as it was returned
    history: list[dict[str, Any]]  # its conversation as chat messages, its output included
    # The body's and input items' bytes (messages: the store counts each once). An input item
    # holds the same text objects as its message, so input text counts twice against the bound:
    # it errs towards less memory, and input-heavy responses leave the store sooner.
    size: int = 0
    input_items: list[dict[str, Any]] = field(default_factory=list)  # its request's, as items
    # Every item id of its conversation: the chain it continued, its input's, its output's.
    item_ids: frozenset[str] = frozenset()


def json_bytes(value: Any) -> int:
    return len(_JSON.encode(value).encode())


class ResponseStore:
    """The last responses made here, by id, bounded in count and in bytes (oldest out)."""

    def __init__(self, max_entries: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # id(message) -> [its bytes, how many stored histories hold it]; the message itself
        # stays alive through those histories.
        self._messages: dict[int, list[int]] = {}
        self._bytes = 0

    def put(
        self,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        input_items: list[dict[str, Any]] | None = None,
        item_ids: frozenset[str] = frozenset(),
    ) -> bool:
        """Store it, the oldest going out as the bounds need; False (and nothing stored or
        evicted) where it alone is past the bytes bound."""
        new = {id(m): m for m in history if id(m) not in self._messages}
        input_items = input_items or []
        size = json_bytes(body) + sum(map(json_bytes, input_items))
        if size + sum(json_bytes(m) for m in new.values()) > self.max_bytes:
            return False
        self.delete(body["id"])
        for message in history:
            counted = self._messages.get(id(message))
            if counted is None:
                counted = self._messages[id(message)] = [json_bytes(message), 0]
                self._bytes += counted[0]
            counted[1] += 1
        self._entries[body["id"]] = StoredResponse(body, history, size, input_items, item_ids)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self.delete(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        for message in entry.history:
            counted = self._messages[id(message)]
            counted[1] -= 1
            if counted[1] == 0:
                del self._messages[id(message)]
                self._bytes -= counted[0]
        return True

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
