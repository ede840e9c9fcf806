"""JSON nested inside strings, and heavy requests: each is a 400 naming its field, and while one
is being prepared every other route (``/health`` and ``/metrics`` here) keeps answering (issue 40)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pagellm.entrypoints.openai.limits import MAX_BODY_CONTAINERS
from tests.helpers.server import MODEL_NAME

pytestmark = pytest.mark.slow

CMPL, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
USER = [{"role": "user", "content": "hi"}]
DEEP_TEXT = "[" * 10_000 + "]" * 10_000
DEEPER_TEXT = "[" * 100_000 + "]" * 100_000


def nested(depth: int) -> Any:
    """A JSON value ``depth`` dicts deep, built without recursion."""
    value: Any = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def call_history(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with ``arguments`` (JSON text)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]  # fmt: skip


def cmpl(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, **extra}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, **extra}


def ref_chain(length: int) -> dict[str, Any]:
    """A schema whose ``$ref``s form a chain ``length`` long (2,000 overflowed llguidance's stack)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(length)}
    defs[f"d{length}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


# (path, body, the param the 400 names, words its message holds)
NESTED_JSON: list[tuple[str, dict[str, Any], str, str]] = [
    (CMPL, cmpl(guided_json=DEEP_TEXT), "guided_json", "nested deeper"),
    (CHAT, chat(guided_json=DEEP_TEXT), "guided_json", "nested deeper"),
    (CMPL, cmpl(structured_outputs={"json": DEEP_TEXT}), "structured_outputs", "nested deeper"),
    (CMPL, cmpl(structured_outputs={"json": "[" * 500 + "]" * 500}), "structured_outputs", "nested deeper"),
    (CMPL, cmpl(guided_json='{"type": "object", "x": 1' + "0" * 5000 + "}"), "guided_json", "not valid JSON"),
    (CHAT, chat(messages=call_history(DEEPER_TEXT)), "messages", "nested deeper"),
    (TOKENIZE, {"messages": call_history(DEEPER_TEXT)}, "messages", "nested deeper"),
    (CHAT, chat(messages=call_history('"just a string"')), "messages", "JSON object"),
    (TOKENIZE, {"messages": call_history('"just a string"')}, "messages", "JSON object"),
    (CHAT, chat(messages=call_history("[1, 2]")), "messages", "JSON object"),
    (CHAT, chat(messages=call_history("{oops")), "messages", "not valid JSON"),
    # JSON values of the body itself nested past the bound (each would break a later json.dumps).
    (CMPL, cmpl(guided_json=nested(300)), None, "nested deeper"),
    (CHAT, chat(chat_template_kwargs={"x": nested(300)}), None, "nested deeper"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(300)}}]), None,
     "nested deeper"),
    # Constraints past the size bound: refused before the grammar engine sees them.
    (CMPL, cmpl(guided_choice=[f"choice {i}" for i in range(200_000)]), "guided_choice", "max_grammar_chars"),
    (CMPL, cmpl(guided_json=ref_chain(5000)), "guided_json", "max_grammar_chars"),
    (CMPL, cmpl(guided_grammar="start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(20_000))),
     "guided_grammar", "max_grammar_chars"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools", "128"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), NESTED_JSON, ids=[str(i) for i in range(len(NESTED_JSON))])
def test_json_inside_strings_and_oversized_constraints_are_400s(
    http: httpx.Client, path: str, body: dict[str, Any], param: str | None, words: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert words in error["message"] and "Traceback" not in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    assert http.get("/health").status_code == 200
    assert http.post(CMPL, json=cmpl()).status_code == 200


def test_a_long_ref_chain_within_the_size_bound_compiles(http: httpx.Client) -> None:
    """1,500 references: a chain of this shape with 2,000 once killed the server."""
    schema = ref_chain(1500)
    assert len(json.dumps(schema)) < 128 * 1024
    response = http.post(CMPL, json=cmpl(guided_json=schema, max_tokens=4))
    assert response.status_code == 200, response.text[:500]


def test_too_many_prompts_are_refused_before_tokenizing(http: httpx.Client) -> None:
    response = http.post(CMPL, json=cmpl(prompt=["x"] * 1025, max_tokens=1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert "--max-prompts-per-request" in response.json()["error"]["message"]
    accepted = http.post(CMPL, json=cmpl(prompt=["x"] * 64, max_tokens=1))
    assert accepted.status_code == 200 and len(accepted.json()["choices"]) == 64


def test_more_messages_than_tokens_is_a_400(http: httpx.Client) -> None:
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    response = http.post(CHAT, json=chat(messages=USER * (limit + 1)))
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_a_body_of_more_objects_than_the_bound_is_a_400_before_validation(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": ""}] * MAX_BODY_CONTAINERS
    response = http.post(CHAT, json=chat(messages=messages))
    assert response.status_code == 400, response.text[:300]
    assert f"more than {MAX_BODY_CONTAINERS} JSON objects and arrays" in response.json()["error"]["message"]
    accepted = http.post(CHAT, json=chat(messages=USER * 8, max_tokens=1))
    assert accepted.status_code == 200, accepted.text[:300]


# ---- /health while one heavy request is being prepared ---------------------------------------

HEALTH_BOUND_S = 5.0  # the issue asks for 1 s; generous for a loaded 2-core CI machine


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


HEAVY: list[tuple[str, str, Callable[[], bytes]]] = [
    # Three million one-character prompts (15 MB): parsed, validated and refused off the loop.
    ("three_million_prompts", CMPL, lambda: raw(cmpl(prompt=["x"] * 3_000_000, max_tokens=1))),
    # 200,000 choices: refused by size, after parsing.
    ("two_hundred_thousand_choices", CMPL, lambda: raw(cmpl(guided_choice=[f"c{i}" for i in range(200_000)]))),
    # A million tiny messages: refused by their count of objects, before validation.
    ("a_million_messages", CHAT, lambda: raw(chat(messages=[{"role": "user", "content": ""}] * 1_000_000))),
    # Ten million characters to tokenize: refused by length, after parsing.
    ("ten_million_characters", TOKENIZE, lambda: raw({"prompt": "word " * 2_000_000})),
]


@pytest.mark.parametrize(("name", "path", "make_body"), HEAVY, ids=[h[0] for h in HEAVY])
def test_health_answers_while_a_heavy_request_is_prepared(
    server: Any, name: str, path: str, make_body: Callable[[], bytes]
) -> None:
    body = make_body()
    done = threading.Event()
    status: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=server.base_url, timeout=300.0) as heavy:
            status.append(heavy.post(path, content=body, headers={"content-type": "application/json"}).status_code)
        done.set()

    sender = threading.Thread(target=send)
    probes: list[float] = []
    with httpx.Client(base_url=server.base_url, timeout=60.0) as probe:
        sender.start()
        while not done.is_set():
            for route in ("/health", "/metrics"):
                start = time.monotonic()
                assert probe.get(route).status_code == 200
                probes.append(time.monotonic() - start)
    sender.join()
    assert status and status[0] < 500, status
    assert probes and max(probes) < HEALTH_BOUND_S, f"{name}: the slowest probe took {max(probes):.2f} s"
