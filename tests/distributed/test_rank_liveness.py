"""A rank, node or Ray actor lost under ``pagellm serve``, one test per executor kind (ranks as
processes, several nodes, Ray actors), each losing one while the engine is idle and one while a
request streams:

- idle: ``/health`` turns 503 naming what was lost, within a bound (no step would notice: the
  heartbeat does), and the engine restarts and serves again;
- busy: the request in flight ends with an error naming it (never a hang; for a node that hangs
  rather than dies, gloo would wait for ever: the heartbeat bounds it), and the server, out of
  restarts, exits 1 for its supervisor.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from pagellm.distributed.heartbeat import HEARTBEAT_TIMEOUT_S
from pagellm.distributed.parallel_state import free_port
from tests.distributed.test_multinode import OPTIONS, _cli_options, _node1
from tests.entrypoints.test_engine_recovery import ARGS, LONG, completion_ok, health, wait_until
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

NOTICED_S = 30.0  # generous: a killed rank is noticed within ~2 s (a silent one: the heartbeat's 10 s)
RESTARTED_S = 180.0


def lost_on_health(http: httpx.Client, who: str) -> bool:
    """/health answers 503 and names ``who`` as the loss."""
    response = http.get("/health")
    return response.status_code == 503 and f"({who} is gone)" in response.text


def stream_and_lose(http: httpx.Client, lose: Callable[[], None]) -> tuple[list[str], float]:
    """Start a long stream, ``lose`` a rank once it generates; its remaining lines (it must end)
    and how long they took to end after the loss."""
    with http.stream("POST", "/v1/completions", json=LONG) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"choices"' in first  # generating: the request is in the engine
        lose()
        lost_at = time.monotonic()
        rest = [line for line in lines if line]
    return rest, time.monotonic() - lost_at


def assert_failed_naming(lines: list[str], who: str) -> None:
    assert any('"error"' in line and f"engine failed while running this request ({who} is gone)" in line
               for line in lines), lines  # fmt: skip
    assert lines[-1] == "data: [DONE]"


def pids(server: RemoteServer, pattern: str) -> list[int]:
    """The pids the server's log gives for ``pattern`` (one group: the pid), oldest first."""
    return [int(pid) for pid in re.findall(pattern, server.logs())]


def kill_when_idle_then_busy(server: RemoteServer, http: httpx.Client, who: str, pid_pattern: str) -> None:
    """The scenario of the one-machine kinds: lose the rank idle (503, restart), then busy (exit 1)."""
    assert completion_ok(http)
    os.kill(pids(server, pid_pattern)[-1], signal.SIGKILL)
    wait_until(lambda: lost_on_health(http, who), NOTICED_S, f"/health 503 naming {who}, killed while idle")
    wait_until(lambda: len(pids(server, pid_pattern)) == 2 and health(http) == 200, RESTARTED_S, "a restarted engine")
    assert completion_ok(http)
    lines, took = stream_and_lose(http, lambda: os.kill(pids(server, pid_pattern)[-1], signal.SIGKILL))
    assert_failed_naming(lines, who)
    assert took < NOTICED_S
    assert server.proc.wait(60) == 1  # out of restarts
    assert "will not be restarted" in server.logs()


def test_ranks_as_processes(tiny_llama_path: str) -> None:
    """--pipeline-parallel-size 2 on one machine: stage 1's process killed."""
    args = [*ARGS, "--num-threads", "2", "--pipeline-parallel-size", "2", "--engine-restarts", "1"]
    with RemoteServer(tiny_llama_path, args) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        kill_when_idle_then_busy(server, http, "rank 1", r"rank 1 started \(pid (\d+)\)")


def test_ray_actors(tiny_llama_path: str) -> None:
    """--distributed-executor-backend ray: stage 1's actor process killed (Ray on this machine,
    started by the engine process)."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagellm[ray]'")
    args = [*ARGS, "--num-threads", "2", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
            "--engine-restarts", "1"]  # fmt: skip
    with RemoteServer(tiny_llama_path, args) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
        kill_when_idle_then_busy(server, http, "the Ray actor of rank 1", r"rank 1: Ray actor started \(pid (\d+)")


def test_several_nodes(tiny_llama_path: str) -> None:
    """--nnodes 2, a stage per node: node 1 killed while idle (noticed through its heartbeat's
    connection), started anew for the restarted engine, then stopped (SIGSTOP: hung, or cut off
    from node 0) mid-stream, where node 0's step would wait in gloo for ever."""
    port = free_port()
    args = ["--served-model-name", "tiny", *_cli_options(OPTIONS), "--num-threads", "1", "--pipeline-parallel-size", "2",
            "--nnodes", "2", "--master-port", str(port), "--engine-restarts", "1"]  # fmt: skip
    with _node1(tiny_llama_path, port, pipeline_parallel_size=2) as node1:
        with RemoteServer(tiny_llama_path, args) as server, httpx.Client(base_url=server.base_url, timeout=60) as http:
            assert completion_ok(http)
            node1.kill()
            wait_until(lambda: lost_on_health(http, "node 1"), NOTICED_S, "/health 503 naming node 1, killed while idle")
            with _node1(tiny_llama_path, port, pipeline_parallel_size=2) as node1:  # the restarted engine waits for it
                wait_until(lambda: health(http) == 200, RESTARTED_S, "a restarted engine with node 1 back")
                assert completion_ok(http)
                lines, took = stream_and_lose(http, lambda: node1.send_signal(signal.SIGSTOP))
                assert_failed_naming(lines, "node 1")
                assert HEARTBEAT_TIMEOUT_S - 1 < took < HEARTBEAT_TIMEOUT_S + NOTICED_S  # the heartbeat's bound
                assert server.proc.wait(60) == 1
                assert "sent no heartbeat" in server.logs()
