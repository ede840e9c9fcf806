"""Structured outputs over HTTP (tiny random model: only the constraint makes its text valid):
response_format, vLLM's structured_outputs and guided_* fields on both endpoints, and the
400s for constraints that cannot work."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server import MODEL_NAME, parse_sse

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
GREEDY = dict(temperature=0.0, max_tokens=64)


def test_chat_json_schema_response_format(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=2, **GREEDY,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_chat_streamed_equals_whole(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, response_format=response_format, **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    jsonschema.validate(json.loads(whole), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"grammar": 'start: "x" "y"+'}, "max_tokens": 6}, lambda t: re.fullmatch("xy+", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ],
    ids=["so-regex", "guided-regex", "so-choice", "guided-choice", "guided-json", "so-grammar", "response-format"],
)
def test_completions_take_every_spelling(client: openai.OpenAI, extra: dict, check) -> None:
    body = dict(GREEDY, **{k: v for k, v in extra.items() if k == "max_tokens"})
    result = client.completions.create(
        model=MODEL_NAME, prompt="Say something:", extra_body={k: v for k, v in extra.items() if k != "max_tokens"},
        **body,
    )
    text = result.choices[0].text
    assert check(text), text


def test_compact_json_unless_asked(client: openai.OpenAI) -> None:
    def text(**so: object) -> str:
        result = client.completions.create(
            model=MODEL_NAME, prompt="JSON:", extra_body={"structured_outputs": {"json": SCHEMA, **so}}, **GREEDY
        )
        return result.choices[0].text

    default, compact = text(), text(disable_any_whitespace=True)
    assert re.fullmatch(r'\{"ok": (true|false), "n": [1-9]\}', default), default
    assert re.fullmatch(r'\{"ok":(true|false),"n":[1-9]\}', compact), compact


def test_logprobs_under_a_constraint_are_json_numbers(http: httpx.Client) -> None:
    body = {
        "model": MODEL_NAME, "messages": MESSAGES, "logprobs": True, "top_logprobs": 10, **GREEDY,
        "structured_outputs": {"choice": ["yes", "no"]},
    }  # fmt: skip
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    content = json.loads(response.text)["choices"][0]["logprobs"]["content"]  # strict JSON: no -Infinity
    # About 5 tokens start a choice ("y", "ye", "yes", "n", "no"): the top 10 reaches forbidden ones.
    alternatives = [t["logprob"] for t in content[0]["top_logprobs"]]
    assert -9999.0 in alternatives and all(v >= -9999.0 for v in alternatives)
    events = parse_sse(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]"


def test_beam_search_under_a_constraint(http: httpx.Client) -> None:
    """use_beam_search with a constraint: every returned beam follows it, on both endpoints."""
    choices = ["alpha", "beta", "gamma delta"]
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 16, "use_beam_search": True, "n": 2,
                                         "guided_choice": choices, **body})  # fmt: skip
        assert response.status_code == 200, response.text
        result = response.json()["choices"]
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in result]
        assert len(texts) == 2 and all(t in choices for t in texts), texts


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "does not compile"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json", "does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "not several"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"guided_grammar": "start: UNDEFINED"}, "guided_grammar", "UNDEFINED"),
    ],
)
def test_constraints_that_cannot_work_are_400s(http: httpx.Client, extra: dict, param: str, message: str) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        response = http.post(path, json={"model": MODEL_NAME, "max_tokens": 4, **body, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
    assert http.get("/health").status_code == 200


def test_a_constraint_the_vocabulary_cannot_spell_is_a_400(http: httpx.Client) -> None:
    """U+4D4C2 has no exact spelling in this byte-level vocabulary: the grammar refuses the
    token its own mask allowed. The request fails alone, as the client's error."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 8, "guided_choice": ["\U0004D4C2"]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs" and "impossible with this model's vocabulary" in error["message"]
    ok = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200 and http.get("/health").status_code == 200
