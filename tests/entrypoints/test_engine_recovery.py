"""``kill -9`` of the engine process, idle and busy: /health turns 503, in-flight requests get
errors (never a hang), then the engine is restarted, or the server exits 1 for its supervisor."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

ARGS = ["--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "8"]
LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}


def engine_pids(server: RemoteServer) -> list[int]:
    """The engine processes the server started, oldest first (it logs each one)."""
    return [int(pid) for pid in re.findall(r"engine process started \(pid (\d+)\)", server.logs())]


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.1)


def health(http: httpx.Client) -> int:
    return http.get("/health").status_code


def completion_ok(http: httpx.Client) -> bool:
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    return response.status_code == 200 and len(response.json()["choices"]) == 1


@pytest.fixture
def restarting(tiny_llama_path: str) -> Iterator[tuple[RemoteServer, httpx.Client]]:
    with RemoteServer(tiny_llama_path, [*ARGS, "--engine-restarts", "2"]) as server:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
            yield server, http


def test_killed_while_idle_is_noticed_and_restarted(restarting: tuple[RemoteServer, httpx.Client]) -> None:
    server, http = restarting
    assert completion_ok(http)
    os.kill(engine_pids(server)[0], signal.SIGKILL)
    wait_until(lambda: health(http) == 503, 5, "/health 503 after the idle engine was killed")
    wait_until(lambda: len(engine_pids(server)) == 2 and health(http) == 200, 120, "a restarted engine")
    assert completion_ok(http)
    assert 'pagellm:engine_restarts_total{model_name="tiny"} 1.0' in http.get("/metrics").text


def signal_mid_stream(server: RemoteServer, http: httpx.Client, sig: signal.Signals) -> list[str]:
    """Send ``sig`` to the engine while a long stream is generating; the stream's remaining lines.

    The stream must end (no hang) with an in-band error, then ``[DONE]``.
    """
    with http.stream("POST", "/v1/completions", json=LONG) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first  # generating: the request is in the engine
        os.kill(engine_pids(server)[0], sig)
        rest = [line for line in lines if line]
    assert any('"error"' in line and "engine failed" in line for line in rest), rest
    assert rest[-1] == "data: [DONE]"
    return rest


def test_killed_while_busy_fails_in_flight_requests_then_restarts(
    restarting: tuple[RemoteServer, httpx.Client],
) -> None:
    server, http = restarting
    signal_mid_stream(server, http, signal.SIGKILL)
    wait_until(lambda: health(http) == 200 and len(engine_pids(server)) == 2, 120, "a restarted engine")
    assert completion_ok(http)


def test_without_restarts_the_server_exits_1(tiny_llama_path: str) -> None:
    with RemoteServer(tiny_llama_path, [*ARGS, "--engine-restarts", "0"]) as server:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
            signal_mid_stream(server, http, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert "will not be restarted" in server.logs()


def test_a_stuck_engine_is_killed_and_restarted(tiny_llama_path: str) -> None:
    """SIGSTOP: the engine process is alive but never answers; the call timeout must end the wait."""
    args = [*ARGS, "--engine-restarts", "1", "--engine-call-timeout", "3"]
    with RemoteServer(tiny_llama_path, args) as server:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
            signal_mid_stream(server, http, signal.SIGSTOP)
            assert "did not answer" in server.logs()
            wait_until(lambda: health(http) == 200 and len(engine_pids(server)) == 2, 120, "a restarted engine")
            assert completion_ok(http)


def test_a_killed_replica_is_noticed_and_every_replica_restarted(tiny_llama_path: str) -> None:
    """--data-parallel-size 2: one replica killed makes the engine unhealthy; the restart starts
    both replicas anew (their requests were failed with the engine), and serving resumes."""
    args = [*ARGS, "--engine-restarts", "1", "--num-threads", "2", "--data-parallel-size", "2"]
    with RemoteServer(tiny_llama_path, args) as server, httpx.Client(base_url=server.base_url, timeout=60.0) as http:
        assert completion_ok(http) and len(engine_pids(server)) == 2
        os.kill(engine_pids(server)[1], signal.SIGKILL)
        wait_until(lambda: health(http) == 503, 5, "/health 503 after a replica was killed")
        wait_until(lambda: len(engine_pids(server)) == 4 and health(http) == 200, 120, "both replicas restarted")
        assert completion_ok(http) and completion_ok(http)
        text = http.get("/metrics").text
        assert 'pagellm:engine_restarts_total{model_name="tiny"} 1.0' in text and 'engine="1"' in text
