"""``priority`` on the OpenAI routes: passed to the engine, refused with a 400 naming it where the
server serves first come, first served (the shared server) or out of vLLM's range, streamed
requests included (before any byte of the stream)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server import MODEL_NAME

pytestmark = pytest.mark.slow

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}),
    ("/v1/responses", {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}),
])  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_priority_needs_the_priority_policy(http: httpx.Client, path: str, body: dict, stream: bool) -> None:
    response = http.post(path, json={**body, "priority": 3, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    assert http.post(path, json={**body, "priority": 0, "stream": stream}).status_code == 200


def test_priority_out_of_range_is_refused(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, "priority": 2**40})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
