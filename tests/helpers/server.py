"""A real ``pagellm serve`` subprocess for tests: free port, wait for /health, always cleaned up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import anthropic
import httpx
import openai

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class RemoteServer:
    """``python -m pagellm.entrypoints.cli serve [MODEL] ARGS`` on 127.0.0.1, ready on return.

    Output goes to a log file (a pipe nobody reads could fill and stall the server); it is
    included in the error when start-up fails or times out.
    """

    def __init__(
        self,
        model: str | None,
        args: list[str] | None = None,
        api_key: str | None = None,
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://{HOST}:{self.port}"
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve"]
        command += [model] if model else []
        command += ["--host", HOST, "--port", str(self.port), *(args or [])]
        command += ["--api-key", api_key] if api_key else []
        self._log = tempfile.NamedTemporaryFile(prefix="pagellm-server-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_until_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    def _wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.logs()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.logs()}")

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def anthropic_client(self, **kwargs: object) -> anthropic.Anthropic:
        """The official ``anthropic`` SDK against this server (it sends the key as ``x-api-key``)."""
        return anthropic.Anthropic(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs
        )

    def logs(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-20000:]

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (killed and -9 if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        try:
            self.terminate(timeout=15.0)
        finally:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def parse_sse(text: str) -> list[dict | str]:
    """The events of an SSE body, checking OpenAI's framing: ``data: {json}`` blocks, ``[DONE]`` last."""
    import json

    assert text.endswith("\n\n"), "every event must end with a blank line"
    events: list[dict | str] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"bad SSE block {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]", "a stream must end with data: [DONE]"
    assert events.count("[DONE]") == 1
    return events


# The shared tiny-model server of the protocol tests (tests/entrypoints/conftest.py).
MODEL_NAME = "tiny"
MODEL_ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256
# A small KV pool starts fast; 4096 token slots still hold 32+ concurrent short requests.
TINY_SERVER_ARGS = [
    "--served-model-name", MODEL_NAME, MODEL_ALIAS,
    "--num-kv-blocks", "256",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-num-seqs", "64",
]
