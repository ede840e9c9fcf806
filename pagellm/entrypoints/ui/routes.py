"""The page's routes: ``/`` (the page), ``/ui/static/*`` (its files), ``/ui/config`` (what the page
must know before its first API call), and the read-only snapshot API under ``/ui/api/`` (which needs
the API key when the server has one; the page, its files and its config do not, so the page can
load and ask for the key before it calls anything that would refuse it).

- ``GET /ui/config``: ``{"api_key_required": bool}``, nothing more (never the key, nor its length);

- ``GET /ui/api/snapshot?replica=R``: one snapshot payload (JSON; ``pagellm.entrypoints.ui.payload``);
- ``GET /ui/api/events?replica=R``: the same as Server-Sent Events, one ``data:`` event per
  period (``FeedOptions.max_rate_hz``), ``{"error": ...}`` events while the engine is unavailable.

``replica`` picks one data-parallel replica (default 0); each has its own pool and queues.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pagellm.entrypoints.openai.errors import BadRequestError, ServiceUnavailableError
from pagellm.entrypoints.ui.feed import SnapshotFeed

STATIC_DIR = Path(__file__).parent / "static"
API_PREFIX = "/ui/api/"  # what the API key guards
CONFIG_PATH = "/ui/config"  # outside API_PREFIX: readable without the key


def install_ui(app: FastAPI, feed: SnapshotFeed, api_key_required: bool) -> None:
    """Add the page, its config and its snapshot API to ``app``."""

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")

    # Public, so that a page asks for the key first rather than learning of it from a 401.
    @app.get(CONFIG_PATH, include_in_schema=False)
    async def config() -> JSONResponse:
        return JSONResponse({"api_key_required": api_key_required}, headers={"Cache-Control": "no-store"})

    @app.get(API_PREFIX + "snapshot")
    async def snapshot(replica: int = 0) -> Response:
        return Response(await feed.payload(replica), media_type="application/json",
                        headers={"Cache-Control": "no-store"})  # fmt: skip

    # Not in /openapi.json: an endless stream is no operation a client (or the API fuzz) can call and finish.
    @app.get(API_PREFIX + "events", include_in_schema=False)
    async def events(replica: int = 0) -> StreamingResponse:
        feed.check_replica(replica)  # a bad replica is a 400 now, not an endless stream of errors
        return StreamingResponse(
            _event_stream(feed, replica), media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )  # fmt: skip


async def _event_stream(feed: SnapshotFeed, replica: int) -> AsyncIterator[bytes]:
    """One event per period until the client leaves or the server shuts down (so a graceful
    shutdown never waits for open pages)."""
    period = feed.options.period_s
    while not feed.engine.is_closing:  # a client that leaves cancels this generator (Starlette)
        try:
            body = await feed.payload(replica)
        except (BadRequestError, ServiceUnavailableError) as exc:
            body = json.dumps({"error": exc.message}).encode()
        yield b"data: " + body + b"\n\n"
        await asyncio.sleep(period)
