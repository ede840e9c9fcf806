"""SIGTERM / SIGINT: in-flight requests end at once, the engine thread stops, the process exits 0."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest

from tests.helpers.server import RemoteServer, parse_sse

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_in_flight_and_exits_zero(tiny_llama_path: str, sig: signal.Signals) -> None:
    with RemoteServer(tiny_llama_path, ["--num-kv-blocks", "64", "--max-model-len", "512"]) as server:
        bodies: dict[str, str] = {}
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "Hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as response:
                text = ""
                for chunk in response.iter_text():
                    text += chunk
                    started.set()
                bodies["stream"] = text

        worker = threading.Thread(target=stream)
        worker.start()
        assert started.wait(30)
        server.proc.send_signal(sig)
        assert server.proc.wait(30) == 0, server.logs()
        worker.join(30)
        # The stream was cut short with an in-band error, and still ended properly with [DONE].
        events = parse_sse(bodies["stream"])
        assert "error" in events[-2] and "shutting down" in events[-2]["error"]["message"]
        assert "Application shutdown complete" in server.logs()
