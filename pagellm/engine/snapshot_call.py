"""One snapshot call through the step loop's inbox: asked on an event loop, answered by the
engine thread between two steps (``AsyncLLMEngine.snapshot``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pagellm.engine.protocol import EngineClient, KVSnapshot

logger = logging.getLogger(__name__)


def _settle(future: asyncio.Future[KVSnapshot], result: KVSnapshot | BaseException) -> None:
    """Runs on the event loop: answer the call (unless its caller gave up waiting)."""
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


@dataclass
class SnapshotCall:
    """Asks for one replica's snapshot; ``future`` (of ``loop``) gets the answer or the error."""

    max_requests: int
    replica: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[KVSnapshot]

    def answer(self, engine: EngineClient) -> None:
        """Take the snapshot (engine thread). A failure is this caller's alone: the engine goes on
        (a dead engine process is noticed by the next step or health check, as always)."""
        result: KVSnapshot | BaseException
        try:
            result = engine.snapshot(self.max_requests, self.replica)
        except Exception as exc:  # noqa: BLE001 -- handed to the caller
            if not isinstance(exc, ValueError):
                logger.warning("taking a snapshot of the engine failed: %r", exc)
            result = exc
        self.settle(result)

    def settle(self, result: KVSnapshot | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result)
        except RuntimeError:
            pass  # that event loop is closed: nobody is waiting
