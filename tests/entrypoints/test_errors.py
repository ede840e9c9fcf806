"""Every rejection is an OpenAI error object with the right status, and never disturbs the server."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.helpers.server import MAX_MODEL_LEN, MODEL_NAME

pytestmark = pytest.mark.slow

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def ok_cmpl(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **extra}


def ok_chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **extra}


# (path, body, status, words the message must contain, the param it names)
CASES: list[tuple[str, Any, int, list[str], str | None]] = [
    (CMPL, {"model": MODEL_NAME, "max_tokens": 2}, 400, ["prompt"], "prompt"),
    (CHAT, {"model": MODEL_NAME, "max_tokens": 2}, 400, ["messages"], "messages"),
    (CMPL, ok_cmpl(temperature="hot"), 400, ["temperature"], "temperature"),
    (CMPL, ok_cmpl(max_tokens="many"), 400, ["max_tokens"], "max_tokens"),
    (CMPL, ok_cmpl(n=1.5), 400, ["n"], "n"),
    (CMPL, ok_cmpl(prompt=[1, "a"]), 400, ["prompt"], "prompt"),
    (CMPL, ok_cmpl(temperature=-0.5), 400, ["temperature", ">= 0"], "temperature"),
    (CHAT, ok_chat(temperature=-1), 400, ["temperature", ">= 0"], "temperature"),
    (CMPL, ok_cmpl(top_p=1.5), 400, ["top_p", "(0, 1]"], "top_p"),
    (CMPL, ok_cmpl(top_p=0), 400, ["top_p", "(0, 1]"], "top_p"),
    (CHAT, ok_chat(n=0), 400, ["n", ">= 1"], "n"),
    (CMPL, ok_cmpl(max_tokens=0), 400, ["max_tokens", ">= 1"], "max_tokens"),
    (CHAT, ok_chat(max_completion_tokens=0), 400, ["max_tokens", ">= 1"], "max_tokens"),
    (CMPL, ok_cmpl(presence_penalty=3), 400, ["presence_penalty", "[-2, 2]"], "presence_penalty"),
    (CMPL, ok_cmpl(logprobs=21), 400, ["logprobs", "20"], "logprobs"),
    (CHAT, ok_chat(logprobs=True, top_logprobs=21), 400, ["top_logprobs", "20"], "top_logprobs"),
    (CHAT, ok_chat(top_logprobs=2), 400, ["top_logprobs", "logprobs"], "top_logprobs"),
    (CMPL, ok_cmpl(max_tokens=MAX_MODEL_LEN), 400, [str(MAX_MODEL_LEN), "maximum context length"], "max_tokens"),
    (CHAT, ok_chat(max_tokens=MAX_MODEL_LEN), 400, [str(MAX_MODEL_LEN), "maximum context length"], "max_tokens"),
    (CMPL, ok_cmpl(prompt="word " * 300), 400, [str(MAX_MODEL_LEN)], "prompt"),
    (CHAT, ok_chat(messages=[]), 400, ["messages", "empty"], "messages"),
    (CHAT, ok_chat(messages=[{"role": "robot", "content": "x"}]), 400, ["role"], "messages"),
    (CMPL, ok_cmpl(prompt=""), 400, ["prompt", "empty"], "prompt"),
    (CMPL, ok_cmpl(prompt=[]), 400, ["prompt", "empty"], "prompt"),
    (CMPL, ok_cmpl(prompt=["fine", ""]), 400, ["prompt", "empty"], "prompt"),
    (CMPL, ok_cmpl(prompt=[10**9]), 400, ["vocabulary"], "prompt"),
    (CMPL, ok_cmpl(stop=[""]), 400, ["stop"], "stop"),
    (CMPL, ok_cmpl(min_tokens=5, max_tokens=2), 400, ["min_tokens"], "min_tokens"),
    (CMPL, ok_cmpl(logit_bias={"5": 1.0}), 400, ["logit_bias"], "logit_bias"),
    (CMPL, ok_cmpl(n=2, best_of=1), 400, ["best_of", ">= n"], "best_of"),
    (CMPL, ok_cmpl(best_of=3, stream=True), 400, ["best_of", "streamed"], "best_of"),
    (CMPL, ok_cmpl(cache_salt=5), 400, ["cache_salt"], "cache_salt"),
    (CMPL, ok_cmpl(model="no-such-model"), 404, ["no-such-model"], "model"),
    (CHAT, ok_chat(model="no-such-model"), 404, ["no-such-model"], "model"),
    ("/tokenize", {"model": MODEL_NAME}, 400, ["prompt", "messages"], "prompt"),
    ("/detokenize", {"model": MODEL_NAME, "tokens": [-1]}, 400, ["vocabulary"], "tokens"),
    ("/v1/nothing-here", {}, 404, ["Not Found"], None),
]


def check_error(response: httpx.Response, status: int, words: list[str], param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] and isinstance(error["message"], str)
    for word in words:
        assert word in error["message"], (word, error["message"])
    assert error["param"] == param, error


def check_still_serving(http: httpx.Client) -> None:
    response = http.post(CMPL, json=ok_cmpl())
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("path", "body", "status", "words", "param"), CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_rejection_then_success(
    http: httpx.Client, path: str, body: Any, status: int, words: list[str], param: str | None
) -> None:
    check_error(http.post(path, json=body), status, words, param)
    check_still_serving(http)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_invalid_json_is_400(http: httpx.Client, path: str) -> None:
    response = http.post(path, content=b'{"prompt": "Hello", ', headers={"content-type": "application/json"})
    check_error(response, 400, ["JSON"], None)
    check_still_serving(http)


def test_streaming_request_errors_before_the_stream(http: httpx.Client) -> None:
    """Validation happens before any SSE byte: a bad streaming request is a plain 400."""
    response = http.post(CMPL, json=ok_cmpl(stream=True, temperature=-1))
    check_error(response, 400, ["temperature"], "temperature")
    check_still_serving(http)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="Hi", top_p=2.0)
    assert "top_p" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=USER)
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
