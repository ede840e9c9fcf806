"""Sharing features over HTTP: beam search, prefix-cache and copy-on-write metrics."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from pagellm import LLM, BeamSearchParams
from tests.helpers.server import MODEL_NAME

PROMPT = "The old lighthouse keeper"


def metric(http: httpx.Client, name: str) -> float:
    """The server's total: summed over the ``engine`` label of each data-parallel replica."""
    text = http.get("/metrics").text
    values = re.findall(rf"^{re.escape(name)}(?:_total)?\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(float(value) for value in values)


def test_completion_beam_search_equals_offline(client: openai.OpenAI, served_model_path: str) -> None:
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3, extra_body={"use_beam_search": True}
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    offline = LLM(served_model_path, num_kv_blocks=64).beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=8),
                                                                  use_tqdm=False)[0]
    assert [c.text for c in response.choices] == [s.text for s in offline.sequences]
    assert response.usage.completion_tokens == sum(
        len(s.tokens) for s in offline.sequences
    ) - 3 * response.usage.prompt_tokens


def test_chat_beam_search_with_length_penalty(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=6,
        n=2,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    assert len(response.choices) == 2
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)
    assert all(c.message.content for c in response.choices)


def test_beam_search_streams_one_chunk_per_beam(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=2, stream=True, extra_body={"use_beam_search": True}
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, n=2, extra_body={"use_beam_search": True}
    )
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


@pytest.mark.parametrize("extra", [{"logprobs": 1}, {"best_of": 3}])
def test_beam_search_rejects_options_it_cannot_honour(http: httpx.Client, extra: dict) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == next(iter(extra))
    ok = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


def test_prefix_cache_hits_and_cow_copies_in_metrics(client: openai.OpenAI, http: httpx.Client) -> None:
    long_prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    hits_before = metric(http, "pagellm:prefix_cache_hits")
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=2, temperature=0)
    assert metric(http, "pagellm:prefix_cache_hits") - hits_before >= 96
    cow_before = metric(http, "pagellm:kv_cache_cow_copies")
    client.completions.create(model=MODEL_NAME, prompt=list(range(2000, 2010)), max_tokens=4, n=3, seed=1)
    assert metric(http, "pagellm:kv_cache_cow_copies") - cow_before == 2  # n - 1: the last owner writes in place
    assert metric(http, "pagellm:kv_cache_shared_blocks") == 0  # nothing is running now
