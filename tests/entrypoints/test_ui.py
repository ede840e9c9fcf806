"""The web page's routes: the page and its files, the snapshot API (bounded, rate-limited, guarded
by the API key), ``--no-ui``. The browser drives the page in ``test_ui_browser.py``."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import httpx
import numpy as np
import pytest

from tests.helpers.server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

KEY = "sk-ui-test-42"
# Bounds of the payload: at most 16,384 cells of 8 bytes (compressed), 64 requests of 256 entries.
MAX_PAYLOAD_BYTES = 512 * 1024
EXTERNAL = re.compile(r"""(src|href)=["']?(https?:)?//|from\s+["'](https?:)?//|url\(["']?(https?:)?//|fetch\(["'](https?:)?//""")


def cells_of(payload: dict) -> dict[str, np.ndarray]:
    """The payload's per-cell arrays, decoded as the page decodes them."""
    n = payload["pool"]["num_cells"]
    raw = zlib.decompress(base64.b64decode(payload["cells"]["data"]))
    assert len(raw) == 8 * n and payload["cells"]["layout"][0] == "position:int32"
    return {
        "position": np.frombuffer(raw, "<i4", n, 0), "owner": np.frombuffer(raw, "<i2", n, 4 * n),
        "ref_cnt": np.frombuffer(raw, np.uint8, n, 6 * n), "cached": np.frombuffer(raw, np.uint8, n, 7 * n),
    }  # fmt: skip


def poll_snapshot(http: httpx.Client, condition: Callable[[dict], bool], timeout_s: float = 30.0) -> dict:
    """The first snapshot that meets ``condition`` (the last one seen when none does in time)."""
    deadline = time.monotonic() + timeout_s
    payload = http.get("/ui/api/snapshot").json()
    while not condition(payload) and time.monotonic() < deadline:
        time.sleep(0.02)
        payload = http.get("/ui/api/snapshot").json()
    return payload


def test_the_page_and_its_files_are_served(server: RemoteServer, http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="kv-grid"' in page.text and 'id="playground"' in page.text
    for name in ("app.js", "api.js", "grid.js", "charts.js", "live.js", "playground.js", "style.css", "favicon.svg"):
        response = http.get(f"/ui/static/{name}")
        assert response.status_code == 200 and len(response.content) > 100, name
        assert not EXTERNAL.search(response.text), name  # nothing loaded from elsewhere (no CDN)
    assert http.get("/ui/static/missing.js").status_code == 404
    assert http.get("/ui/config").json() == {"api_key_required": False}


def test_snapshot_of_an_idle_server(http: httpx.Client) -> None:
    payload = http.get("/ui/api/snapshot").json()
    assert payload["version"] == 1 and payload["model"] == MODEL_NAME
    assert (payload["replica"], payload["num_replicas"]) == (0, 1)
    pool = payload["pool"]
    assert pool["num_blocks"] == 256 and pool["num_cells"] == 256 and pool["blocks_per_cell"] == 1
    cells = cells_of(payload)
    assert not (cells["owner"] >= 0).any() and not cells["ref_cnt"].any()
    assert set(payload["stats"]) >= {"num_running", "num_waiting", "num_generated_tokens", "prefix_cache_hits"}
    assert set(payload["latency"]["ttft"]) == {"p50", "p90", "p99", "count", "total"}


def test_snapshot_shows_requests_sharing_a_prefix_while_they_run(server: RemoteServer, http: httpx.Client) -> None:
    system = "You are a careful assistant who explains paged attention in detail. " * 3
    body = {"model": MODEL_NAME, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    first_token = [threading.Event(), threading.Event()]
    release = threading.Event()

    def run(i: int) -> None:
        request = dict(body, prompt=system + f"Question {i}: why blocks?")
        with httpx.stream("POST", server.url("/v1/completions"), json=request, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_token[i].set()
                    release.wait(60)  # keep reading slowly: the request stays in the engine meanwhile

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        assert all(event.wait(60) for event in first_token)
        # The first answer may be the period's cached picture, taken before they were admitted.
        payload = poll_snapshot(http, lambda p: len(p["requests"]) == 2)
        running = [r for r in payload["requests"] if r["status"] == "running"]
        assert len(running) == 2
        cells = cells_of(payload)
        shared = np.flatnonzero(cells["ref_cnt"] == 2)
        prompt_blocks = min(r["prompt"] for r in running) // payload["pool"]["block_size"]
        assert len(shared) >= prompt_blocks - 1 > 0  # the common prefix's full blocks, held by both
        assert set(shared.tolist()) <= set(running[0]["table"]) & set(running[1]["table"])
        assert (cells["owner"][shared] == 0).all()  # the older request owns the shared ones
        for i, r in enumerate(running):
            assert r["blocks"] == len(r["table"]) and (cells["owner"][r["table"]] >= 0).all()
            assert r["computed"] <= r["tokens"]
    finally:
        release.set()
        for thread in threads:
            thread.join(120)
    done = poll_snapshot(http, lambda p: not p["requests"])
    assert done["requests"] == [] and not (cells_of(done)["owner"] >= 0).any()
    assert done["pool"]["num_cached_free"] > 0  # the prompts' full blocks stay in the prefix cache


def test_events_stream_snapshots_and_bad_replicas_are_400(http: httpx.Client) -> None:
    events = []
    with http.stream("GET", "/ui/api/events") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 3:
                    break
    assert all(e["version"] == 1 and len(json.dumps(e)) < MAX_PAYLOAD_BYTES for e in events)
    assert events[0]["time"] < events[2]["time"]  # refreshed, not the same picture replayed
    for path in ("/ui/api/snapshot", "/ui/api/events"):
        for replica in ("1", "-1", "x"):
            response = http.get(path, params={"replica": replica})
            assert response.status_code == 400, (path, replica)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def secured(tiny_llama_path: str) -> Iterator[RemoteServer]:
    with RemoteServer(tiny_llama_path, ["--num-kv-blocks", "64"], api_key=KEY) as remote:
        yield remote


def test_snapshot_api_needs_the_key_but_the_page_does_not(secured: RemoteServer) -> None:
    assert httpx.get(secured.url("/")).status_code == 200
    assert httpx.get(secured.url("/ui/static/app.js")).status_code == 200
    assert httpx.get(secured.url("/ui/config")).json() == {"api_key_required": True}  # and nothing of the key
    for path in ("/ui/api/snapshot", "/ui/api/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            response = httpx.get(secured.url(path), headers=headers, timeout=30)
            assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    ok = httpx.get(secured.url("/ui/api/snapshot"), headers=secured.headers, timeout=30)
    assert ok.status_code == 200 and ok.json()["pool"]["num_blocks"] == 64


def test_no_ui_serves_no_page(tiny_llama_path: str) -> None:
    with RemoteServer(tiny_llama_path, ["--num-kv-blocks", "32", "--no-ui"]) as remote:
        for path in ("/", "/ui/static/app.js", "/ui/config", "/ui/api/snapshot"):
            response = httpx.get(remote.url(path), timeout=30)
            assert response.status_code == 404, path
            assert "error" in response.json()
        assert httpx.get(remote.url("/health")).status_code == 200


def test_an_open_page_does_not_hold_up_shutdown(tiny_llama_path: str) -> None:
    """SIGTERM with an event stream open: the stream ends with the engine loop, so uvicorn's
    graceful shutdown never has to cancel it at its timeout."""
    with RemoteServer(tiny_llama_path, ["--num-kv-blocks", "32"]) as remote:
        first_event = threading.Event()
        ended = threading.Event()

        def read() -> None:
            try:
                with httpx.stream("GET", remote.url("/ui/api/events"), timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            first_event.set()
            except httpx.HTTPError:
                pass
            ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first_event.wait(30)
        assert remote.terminate() == 0
        assert ended.wait(30)
        assert "timeout graceful shutdown exceeded" not in remote.logs()
