"""``/v1/embeddings`` through the official ``openai`` SDK, and vLLM's ``/score`` and ``/rerank``
(tiny random model, served by the shared server: its last token, normalized): the forms of input,
both encodings, usage, and every refusal as OpenAI's error object."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.helpers.server import MAX_MODEL_LEN, MODEL_NAME

TEXTS = ["The capital of France is Paris.", "Bananas are yellow.", "Paris is the capital of France."]


def _vectors(client: openai.OpenAI, inputs: object, **kwargs: object) -> list[np.ndarray]:
    response = client.embeddings.create(model=MODEL_NAME, input=inputs, encoding_format="float", **kwargs)
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return [np.asarray(d.embedding) for d in response.data]


def test_texts_token_ids_and_both_encodings(client: openai.OpenAI, http: httpx.Client) -> None:
    response = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the SDK asks for base64 and decodes it
    vectors = [np.asarray(d.embedding) for d in response.data]
    assert len(vectors) == 3 and all(v.shape == (64,) for v in vectors)
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-5 for v in vectors)
    floats = _vectors(client, TEXTS)
    for a, b in zip(vectors, floats):
        np.testing.assert_allclose(a, b, atol=1e-6)  # base64 holds the same float32 values
    ids = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXTS[1]}).json()["tokens"]
    np.testing.assert_allclose(_vectors(client, ids)[0], floats[1], atol=1e-5)  # token ids: the same vector
    np.testing.assert_allclose(_vectors(client, [ids, ids])[1], floats[1], atol=1e-5)
    tokens = sum(len(http.post("/tokenize", json={"model": MODEL_NAME, "prompt": t}).json()["tokens"]) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, floats[0], atol=1e-6)
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == MODEL_NAME


def test_vllm_options(client: openai.OpenAI, http: httpx.Client) -> None:
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": False}).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1.0) > 1e-3
    ids = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXTS[0]}).json()["tokens"]
    cut = http.post("/v1/embeddings", json={"input": TEXTS[0], "truncate_prompt_tokens": 3}).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"], _vectors(client, ids[-3:])[0], atol=1e-5)
    assert cut["usage"]["prompt_tokens"] == 3
    full = http.post("/v1/embeddings", json={"input": [1] * MAX_MODEL_LEN})  # an input may fill the context
    assert full.status_code == 200, full.text


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "must not be empty"),
        ({"input": ""}, "input", "must not be empty"),
        ({"input": [[1, 2], []]}, "input", "must not be empty"),
        ({"input": [[1, 2, 10**9]]}, "input", "out of the vocabulary"),
        ({"input": [1] * (MAX_MODEL_LEN + 1)}, "input", "maximum context length"),
        ({"input": ["x"] * 5000}, "input", "more than the server's limit"),
        ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "positive integer"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "greater than or equal to 1"),
        ({"input": "hi", "model": "other"}, "model", "does not exist"),
        ({"input": {"text": "hi"}}, "input", "input"),
    ],
)
def test_refusals_are_openai_errors(http: httpx.Client, body: dict, param: str, words: str) -> None:
    response = http.post("/v1/embeddings", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_score_and_rerank_are_cosine_similarities(client: openai.OpenAI, http: httpx.Client) -> None:
    vectors = _vectors(client, TEXTS)
    expected = [float(vectors[0] @ v) for v in vectors[1:]]
    one_to_many = http.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1] and one_to_many["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in one_to_many["data"]], expected, atol=1e-5)
    pairs = http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]],
                               [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], atol=1e-5)  # fmt: skip
    ranked = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}).json()
    best = int(np.argmax(expected))
    assert [r["index"] for r in ranked["results"]] == [best]
    assert ranked["results"][0]["document"]["text"] == TEXTS[1 + best]
    np.testing.assert_allclose(ranked["results"][0]["relevance_score"], expected[best], atol=1e-5)
    every = http.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "return_documents": False})
    results = every.json()["results"]
    assert len(results) == 2 and "document" not in results[0]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": [], "text_2": ["c"]}, "text_1"),
        ("/score", {"text_1": "a"}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "", "documents": ["b"]}, "text"),
        ("/rerank", {"query": "a", "documents": [f"d{i}" for i in range(5000)]}, "text"),  # over the prompt limit
        ("/rerank", {"query": "a", "documents": "not a list"}, "documents"),
        ("/score", {"text_1": "a", "text_2": [[1, 2]]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_scoring_refusals(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert http.post("/score", json={"text_1": "a", "text_2": "b"}).status_code == 200  # still serving
