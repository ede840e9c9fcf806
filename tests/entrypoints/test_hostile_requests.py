"""Requests that once killed or froze the server: each gets a 4xx (or a right 2xx), and after it
the server is still healthy and answers a normal request."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.helpers.server import MODEL_NAME

pytestmark = pytest.mark.slow

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
LOOP_TEMPLATE = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"


def cmpl(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **extra}


# (path, JSON text of the body, status, the param the error names)
HOSTILE: list[tuple[str, str, int, str | None]] = [
    (CMPL, json.dumps(cmpl(seed=2**64)), 400, "seed"),
    (CMPL, json.dumps(cmpl(seed=2**64 - 1, n=3)), 400, "seed"),
    (CMPL, json.dumps(cmpl(seed=2**63 - 2, n=3)), 400, "seed"),  # seed + 2 overflows int64
    (CMPL, json.dumps(cmpl(seed=-(2**63) - 1)), 400, "seed"),
    (CMPL, json.dumps(cmpl(n=100000)), 400, "n"),
    (CMPL, json.dumps(cmpl(best_of=100000)), 400, "best_of"),
    (CMPL, json.dumps(cmpl(n=100000, use_beam_search=True)), 400, "n"),
    (CHAT, json.dumps(chat(chat_template_kwargs={"chat_template": LOOP_TEMPLATE})), 400, "chat_template_kwargs"),
    (CHAT, json.dumps(chat(chat_template_kwargs={"chat_template": "{{ 'A' * 2000000000 }}"})), 400,
     "chat_template_kwargs"),
    (CHAT, json.dumps(chat(chat_template_kwargs={"tools": [{"type": "function"}]})), 400, "chat_template_kwargs"),
    (CHAT, json.dumps(chat(chat_template_kwargs={"tokenize": True})), 400, "chat_template_kwargs"),
    (CMPL, json.dumps(cmpl(prompt="a\ud800b")), 400, None),  # json.dumps escapes the lone surrogate
    (CMPL, json.dumps(cmpl(prompt=["ok", "\udfff"])), 400, None),
    (CMPL, json.dumps(cmpl(stop=["\ud800"])), 400, None),
    (CMPL, json.dumps(cmpl(cache_salt="\ud800")), 400, None),
    (CHAT, json.dumps(chat(messages=[{"role": "user", "content": "\ud800"}])), 400, None),
    ("/tokenize", json.dumps({"prompt": "\ud800"}), 400, None),
    (CMPL, '{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": Infinity}', 400, "temperature"),
    (CMPL, '{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "top_p": NaN}', 400, "top_p"),
    (CMPL, '{"model": "tiny", "prompt": "Hello", "max_tokens": 2, "repetition_penalty": 1e999}', 400,
     "repetition_penalty"),
    (CMPL, json.dumps(cmpl(logprobs=10**9)), 400, "logprobs"),
    (CMPL, json.dumps(cmpl(max_tokens=2**63)), 400, "max_tokens"),
    (CMPL, json.dumps(cmpl(stop=["x"] * 17)), 400, "stop"),
    (CMPL, json.dumps(cmpl(stop=["x" * 1025])), 400, "stop"),
    (CMPL, json.dumps(cmpl(stop_token_ids=[2**70])), 400, "stop_token_ids"),
    (CMPL, json.dumps(cmpl(stop_token_ids=[10**9])), 400, "stop_token_ids"),
    (CMPL, json.dumps(cmpl(n=2, use_beam_search=True, length_penalty=1e308)), 200, None),
    (CMPL, json.dumps(cmpl(n=2, use_beam_search=True, length_penalty=-1e308)), 200, None),
    (CMPL, json.dumps(cmpl(top_k=2**70)), 200, None),
]


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    response = http.post(CMPL, json=cmpl())
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def post_raw(http: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    content = body.encode("ascii") if isinstance(body, str) else body
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "status", "param"), HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_request_then_healthy(http: httpx.Client, path: str, body: str, status: int, param: str | None) -> None:
    response = post_raw(http, path, body)
    assert response.status_code == status, response.text
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in error["message"] and "Error(" not in error["message"]
        if param is not None:
            assert error["param"] == param, error
    assert_still_serving(http)


def test_a_huge_prompt_is_refused_before_tokenizing(http: httpx.Client) -> None:
    body = json.dumps(cmpl(prompt="word " * 6_000_000))  # 30 million characters
    response = post_raw(http, CMPL, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "characters" in response.json()["error"]["message"]
    assert_still_serving(http)


def test_invalid_utf8_and_oversized_bodies(http: httpx.Client) -> None:
    bad = post_raw(http, CMPL, b'{"model": "tiny", "prompt": "\xff\xfe", "max_tokens": 2}')
    assert bad.status_code == 400
    too_big = post_raw(http, CMPL, b" " * (33 * 1024 * 1024))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "body_too_large"
    assert_still_serving(http)


def test_models_list_names_no_paths(http: httpx.Client) -> None:
    for card in http.get("/v1/models").json()["data"]:
        assert "/" not in card["root"] and card["root"] == MODEL_NAME
