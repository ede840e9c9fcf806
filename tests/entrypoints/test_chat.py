"""POST /v1/chat/completions against a real server: template, streaming, logprobs, usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.server import MODEL_NAME
from tests.helpers.server import parse_sse

pytestmark = pytest.mark.slow

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
]
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def stream_chat(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in reasons
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_basic_chat_and_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion" and result.model == MODEL_NAME
    [choice] = result.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    rendered = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}).json()
    assert result.usage.prompt_tokens == rendered["count"]
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == rendered["count"] + 6


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=9, max_completion_tokens=3, **GREEDY
    )
    assert result.usage.completion_tokens == 3


def test_default_max_tokens_fills_the_context(client: openai.OpenAI) -> None:
    """Without max_tokens a chat answer may run to max_model_len (as vLLM)."""
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert result.usage.total_tokens == 256 and result.choices[0].finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_equals_whole_and_role_first(client: openai.OpenAI, n: int) -> None:
    kwargs = dict(max_tokens=20, n=n, **GREEDY)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)
    texts, reasons, chunks = stream_chat(client, **kwargs)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    first_per_choice: dict[int, object] = {}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id
        for choice in chunk.choices:
            first_per_choice.setdefault(choice.index, choice)
            if choice is not first_per_choice[choice.index]:
                assert choice.delta.role is None
    assert sorted(first_per_choice) == list(range(n))
    assert all(c.delta.role == "assistant" for c in first_per_choice.values())


def test_logprobs_chat_format(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 3
        ranked = [t.logprob for t in item.top_logprobs]
        assert ranked == sorted(ranked, reverse=True) and abs(ranked[0] - item.logprob) < 1e-4  # greedy
    assert "".join(i.token for i in content) == result.choices[0].message.content

    _, _, chunks = stream_chat(client, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    streamed = [i.token for c in chunks for ch in c.choices if ch.logprobs for i in ch.logprobs.content]
    assert streamed == [i.token for i in content]


def test_logprobs_without_top(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(item.top_logprobs == [] for item in result.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_stop_string(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, **GREEDY)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30, stop=stop, **GREEDY)
    assert result.choices[0].message.content == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    texts, reasons, _ = stream_chat(client, max_tokens=30, stop=[stop], **GREEDY)
    assert texts[0] == text[: text.index(stop)] and reasons[0] == "stop"


def test_seed_and_options(client: openai.OpenAI) -> None:
    def ask() -> str:
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0.9, top_p=0.95, seed=5,
            presence_penalty=0.3, frequency_penalty=0.3,
            extra_body={"top_k": 50, "min_p": 0.0, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True},
        )
        return result.choices[0].message.content

    assert ask() == ask()


def test_content_parts_and_developer_role(client: openai.OpenAI, http: httpx.Client) -> None:
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    a = http.post("/tokenize", json={"messages": parts}).json()["tokens"]
    b = http.post("/tokenize", json={"messages": plain}).json()["tokens"]
    assert a == b
    result = client.chat.completions.create(model=MODEL_NAME, messages=parts, max_tokens=2)
    assert result.choices[0].message.role == "assistant"


def test_stream_usage_and_raw_framing(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    response = http.post("/v1/chat/completions", json=body)
    events = parse_sse(response.text)
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"


def test_an_image_to_a_text_model_is_a_400(client: openai.OpenAI) -> None:
    url = "data:image/png;base64,iVBORw0KGgo="
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError, match="this model takes no images"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": parts}], max_tokens=2)
