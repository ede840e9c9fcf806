"""GET /health, /version, /v1/models and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest

import pagellm
from pagellm.kernels.plan import GEMM_PATHS
from tests.helpers.server import MAX_MODEL_LEN, MODEL_ALIAS, MODEL_NAME

pytestmark = pytest.mark.slow


def test_health_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    version = http.get("/version").json()
    assert version["version"] == pagellm.__version__
    plan = version["kernel_plan"]
    assert plan["device"] == "cpu" and plan["dtype"] in ("float32", "bfloat16")
    assert plan["gemm"] in GEMM_PATHS
    assert plan["attention"] in ("cpu_paged", "torch_sdpa", "reference")
    assert set(plan) >= {"cpu", "kernel_target", "norm", "rotary", "argmax"}


def test_models_list(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME, MODEL_ALIAS]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    for card in raw["data"]:
        assert card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN and card["owned_by"]
    assert client.models.retrieve(MODEL_ALIAS).id == MODEL_ALIAS
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_anthropics_client_lists_the_models_too(server) -> None:
    with server.anthropic_client() as claude:
        page = claude.models.list()
        assert [m.id for m in page.data] == [MODEL_NAME, MODEL_ALIAS] and not page.has_more
        assert page.data[0].display_name == MODEL_NAME and page.data[0].type == "model"
        assert claude.models.retrieve(MODEL_NAME).created_at.year >= 2026


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Hello world, héllo wörld!"
    body = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]}).json()
    assert back == {"prompt": text}
    with_strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(with_strs["token_strs"]) == with_strs["count"]


def test_tokenize_special_tokens_flag(http: httpx.Client) -> None:
    plain = http.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).json()
    default = http.post("/tokenize", json={"prompt": "Hi"}).json()
    assert default["tokens"][-len(plain["tokens"]):] == plain["tokens"]


def test_tokenize_messages_uses_chat_template(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    body = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert "What is 2+2?" in text and len(text) > len("What is 2+2?")  # the template adds role markup
    no_gen = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < body["count"]
