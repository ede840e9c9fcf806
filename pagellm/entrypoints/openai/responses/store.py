"""Stored responses (``store``, the default): what ``GET /v1/responses/{id}`` answers and what a
later request's ``previous_response_id`` continues from.

Bounded three ways, so that clients cannot grow the server: at most ``max_responses`` entries,
at most ``max_chars`` characters of stored conversations and response objects in all (the
oldest entries go first),
and each entry expires ``ttl_s`` after it was stored. Kept in this process only: a restart
forgets them (a 404 then, as for an expired one).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_MAX_CHARS = 64 * 2**20
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its chat messages, input then output (instructions excluded)
    chars: int
    expires: float


def conversation_chars(conversation: list[dict[str, Any]]) -> int:
    """What a conversation weighs against the store's bound (its text)."""
    total = 0
    for message in conversation:
        content = message.get("content") or ""
        if isinstance(content, list):  # (text and image parts: their text and data URLs)
            content = "".join(str(p.get("text") or (p.get("image_url") or {}).get("url") or "") for p in content)
        total += len(content) + len(message.get("reasoning_content") or "")
        total += sum(len(c["function"]["arguments"]) + len(c["function"]["name"]) for c in message.get("tool_calls") or ())
    return total


class ResponseStore:
    """Thread-safe: the event loop stores and reads, worker threads read."""

    def __init__(
        self, max_responses: int = DEFAULT_MAX_RESPONSES, max_chars: int = DEFAULT_MAX_CHARS,
        ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_responses < 1 or max_chars < 1 or ttl_s <= 0:
            raise ValueError("the response store needs room for one response and a positive lifetime")
        self.max_responses, self.max_chars, self.ttl_s, self.clock = max_responses, max_chars, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._chars = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store a response; False when it alone (its conversation and the response object)
        exceeds the store (not stored)."""
        chars = conversation_chars(conversation) + len(json.dumps(response))
        if chars > self.max_chars:
            return False
        with self._lock:
            self._expire()
            self._drop(response_id)
            while self._entries and (len(self._entries) >= self.max_responses or self._chars + chars > self.max_chars):
                self._drop(next(iter(self._entries)))
            self._entries[response_id] = StoredResponse(response, conversation, chars, self.clock() + self.ttl_s)
            self._chars += chars
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._chars -= entry.chars
        return entry is not None

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if oldest.expires > now:
                return
            self._drop(oldest_id)
