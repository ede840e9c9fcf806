"""Operator switches of the server's guards: the API key from the environment, trusted request
chat templates, the body size limit, and admission control (503 + Retry-After, counted)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

KEY = "sk-from-the-environment"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def guarded(tiny_llama_path: str) -> Iterator[tuple[RemoteServer, httpx.Client]]:
    args = [
        "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-model-len", "512",
        "--trust-request-chat-template", "--max-request-body", "64KiB",
        "--max-num-seqs", "1", "--max-waiting-requests", "0",
    ]
    with RemoteServer(tiny_llama_path, args, env={"PAGELLM_API_KEY": KEY}) as server:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.base_url, timeout=60.0, headers=headers) as http:
            yield server, http


def test_api_key_from_the_environment(guarded: tuple[RemoteServer, httpx.Client]) -> None:
    server, http = guarded
    assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 401
    assert http.get("/v1/models").status_code == 200
    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as cmdline:
        assert KEY.encode() not in cmdline.read()  # nothing for ps to show


def test_empty_api_key_is_an_error_not_no_auth() -> None:
    for args, env in ((["--api-key", ""], {}), ([], {"PAGELLM_API_KEY": " "})):
        command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--port", "1", *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**_env(), **env})
        assert done.returncode == 1 and "empty" in done.stderr, done.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PAGELLM_API_KEY"}


def test_trusted_request_chat_template_is_used(guarded: tuple[RemoteServer, httpx.Client]) -> None:
    _, http = guarded
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": TEMPLATE}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    tokens = http.post("/tokenize", json={"prompt": "<user>hi<assistant>", "add_special_tokens": False}).json()
    assert response.json()["usage"]["prompt_tokens"] == tokens["count"]


def test_body_limit_is_413(guarded: tuple[RemoteServer, httpx.Client]) -> None:
    _, http = guarded
    response = http.post("/v1/completions", json={"prompt": "x" * 70_000, "max_tokens": 1})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_admission_beyond_capacity_is_503_with_retry_after(guarded: tuple[RemoteServer, httpx.Client]) -> None:
    """Capacity is one request: of 8 sent at once (each 500 tokens long), the first is admitted
    and the others arrive while it runs. (The exact bound is tested in test_loop_guards.)"""
    server, http = guarded
    long = {"prompt": "Hello", "max_tokens": 500, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, headers=http.headers) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=long) for _ in range(8)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes[0] == 200 and codes[-1] == 503, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "overloaded"
    assert http.get("/health").status_code == 200  # full is not unhealthy
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
    rejected = 'pagellm:requests_rejected_total{model_name="tiny",reason="overloaded"} '
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith(rejected))
    assert float(line.split()[-1]) == codes.count(503)
