"""POST /v1/completions against a real server: shapes, parameters, streaming, logprobs, usage."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.server import MODEL_ALIAS, MODEL_NAME
from tests.helpers.server import parse_sse

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def prompt_len(http: httpx.Client, text: str) -> int:
    return http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()["count"]


def stream_text(client: openai.OpenAI, **kwargs: object) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Concatenated text and finish reason per choice index, plus the raw chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(client.completions.create(model=MODEL_NAME, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                assert choice.index not in reasons, "finish_reason must come once per choice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_basic_response_shape_and_usage(client: openai.OpenAI, http: httpx.Client) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, **GREEDY)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.model == MODEL_NAME and result.created > 0
    [choice] = result.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert result.usage.prompt_tokens == prompt_len(http, PROMPT)
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_default_max_tokens_is_16_and_alias_name_works(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_ALIAS, prompt=PROMPT, **GREEDY)
    assert result.model == MODEL_ALIAS
    assert result.usage.completion_tokens == 16


def test_model_may_be_omitted(http: httpx.Client) -> None:
    body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert body["model"] == MODEL_NAME and body["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_text_equals_whole_text(client: openai.OpenAI, n: int) -> None:
    kwargs = dict(prompt=PROMPT, max_tokens=24, n=n, **GREEDY)
    whole = client.completions.create(model=MODEL_NAME, **kwargs)
    texts, reasons, _ = stream_text(client, **kwargs)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert len(whole.choices) == n and whole.usage.completion_tokens == 24 * n


def test_several_prompts_number_choices_prompt_major(client: openai.OpenAI, http: httpx.Client) -> None:
    prompts = ["Hello", "A much longer second prompt than the first"]
    result = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, **GREEDY) for p in prompts]
    for i, single in enumerate(singles):
        assert result.choices[2 * i].text == single.choices[0].text  # greedy: index = prompt_i * n + j
        assert result.choices[2 * i + 1].text == single.choices[0].text
    assert result.usage.prompt_tokens == sum(prompt_len(http, p) for p in prompts)
    assert result.usage.completion_tokens == 4 * 4
    texts, _, _ = stream_text(client, prompt=prompts, n=2, max_tokens=4, **GREEDY)
    assert texts == {c.index: c.text for c in result.choices}


def test_token_id_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=3, **GREEDY)
    assert len(several.choices) == 2 and several.usage.prompt_tokens == len(ids) + 2


def test_logprobs_shape(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert logprob >= max(top.values()) - 1e-4  # greedy picks the most likely token
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))


def test_streamed_logprobs_match(client: openai.OpenAI) -> None:
    kwargs = dict(prompt=PROMPT, max_tokens=8, logprobs=2, **GREEDY)
    whole = client.completions.create(model=MODEL_NAME, **kwargs).choices[0].logprobs
    _, _, chunks = stream_text(client, **kwargs)
    tokens, offsets = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset


def test_echo(client: openai.OpenAI, http: httpx.Client) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **GREEDY)
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    n_prompt = prompt_len(http, PROMPT)
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    texts, _, _ = stream_text(client, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY)
    assert texts[0] == echoed.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, **GREEDY).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, stop=[stop], **GREEDY)
    assert result.choices[0].text == cut
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].model_extra["stop_reason"] == stop
    texts, reasons, _ = stream_text(client, prompt=PROMPT, max_tokens=30, stop=stop, **GREEDY)
    assert texts[0] == cut and reasons[0] == "stop"
    kept = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=30, stop=stop, temperature=0.0,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == cut + stop


def test_stop_token_ids_and_min_tokens(client: openai.OpenAI) -> None:
    # Half the vocabulary stops: the first two tokens are forced odd by min_tokens, then an even one ends it.
    even_ids = list(range(0, 49152, 2))
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=60, temperature=0.0,
        extra_body={"ignore_eos": True, "stop_token_ids": even_ids, "min_tokens": 2},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.model_extra["stop_reason"], int) and choice.model_extra["stop_reason"] % 2 == 0
    assert 3 <= result.usage.completion_tokens < 60


def test_seeds_are_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str]:
        result = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, n=2,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in result.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # the n samples get different seeds
    assert sample(99) != first


def test_sampling_options_are_accepted(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
        extra_body={
            "top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2, "ignore_eos": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False,
        },
    )
    assert result.usage.completion_tokens == 8 and result.choices[0].finish_reason == "length"


def test_stream_usage_chunk(client: openai.OpenAI) -> None:
    _, _, chunks = stream_text(
        client, prompt=PROMPT, max_tokens=5, n=2, stream_options={"include_usage": True}, **GREEDY
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(c.usage is None for c in body)
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_framing(http: httpx.Client) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["text"] for c in chunks[:-1])  # no empty deltas before the last


def test_best_of_returns_the_most_likely_samples(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, best_of=4, temperature=1.0, seed=3, logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert result.usage.completion_tokens == 12  # only the returned samples count
    totals = [sum(c.logprobs.token_logprobs) for c in result.choices]
    assert totals[0] >= totals[1]  # best first


def test_cache_salt_is_accepted(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, **GREEDY)
    salted = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0,
        extra_body={"ignore_eos": True, "cache_salt": "tenant-a"},
    )
    assert salted.choices[0].text == plain.choices[0].text
