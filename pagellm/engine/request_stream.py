"""The consumer side of a request in the step loop: the queue its outputs land in on its event
loop (``Channel``), the async iterator a caller reads (``RequestStream``), and the hand-over from
the engine thread (``Deliveries``: one wake-up per event loop per step, not one per request).

Apart from ``async_engine`` because it is the half of the loop that runs on the event loop; the
engine thread only fills ``Deliveries``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from pagellm.outputs import RequestOutput

StreamItem = RequestOutput | BaseException


@dataclass
class Channel:
    """The consumer side of one request: its event loop and the queue it awaits."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)


def _put_all(items: list[tuple[asyncio.Queue[StreamItem], StreamItem]]) -> None:
    """Runs on the event loop: hand one step's outputs to their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)


class Deliveries:
    """Items bound for requests' queues, grouped by event loop so that ``post`` wakes each loop
    once (called from the engine thread)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StreamItem], StreamItem]]] = {}

    def add(self, channel: Channel, item: StreamItem) -> None:
        self._by_loop.setdefault(channel.loop, []).append((channel.queue, item))

    def post(self) -> None:
        for loop, items in self._by_loop.items():
            if items:
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:
                    pass  # that event loop is closed: nobody is listening any more
        self._by_loop = {}


def post_error(channels: Iterable[Channel], error: BaseException) -> None:
    """Send one error to each channel (once, however often it is listed)."""
    deliveries = Deliveries()
    for channel in {id(c): c for c in channels}.values():
        deliveries.add(channel, error)
    deliveries.post()


class RequestStream(AsyncIterator[RequestOutput]):
    """One submitted request's outputs. Closing it before the last output aborts the request;
    so does dropping it unread (a response that never started), as a last resort."""

    def __init__(self, channel: Channel, request_id: str, abort: Callable[[str], None]) -> None:
        self._channel = channel
        self._request_id = request_id
        self._abort = abort
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._channel.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._abort(self._request_id)

    def __del__(self) -> None:
        self.close()
