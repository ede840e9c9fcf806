"""The FastAPI app in-process over a fake engine: what happens when the engine loop dies, and the
OpenAPI document of the bodies the routes parse themselves."""

from __future__ import annotations

import json
import re

import pytest
from fastapi.testclient import TestClient

from pagellm.config import LimitsConfig
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.input_processor import InputProcessor
from pagellm.entrypoints.openai.api_server import ServerSettings, build_app
from pagellm.metrics.prometheus import PrometheusMetrics
from tests.helpers.fake_engine import FakeEngine, TinyTokenizer


def make_client() -> tuple[TestClient, FakeEngine]:
    fake = FakeEngine()
    fake.tokenizer = TinyTokenizer()  # type: ignore[attr-defined]
    fake.input_processor = InputProcessor(fake.tokenizer, vocab_size=100, max_model_len=128)  # type: ignore[attr-defined]
    metrics = PrometheusMetrics("fake", stats=lambda: fake.stats)
    engine = AsyncLLMEngine(fake, metrics)  # type: ignore[arg-type]
    app = build_app(engine, ServerSettings(served_model_names=["fake"]), metrics)
    return TestClient(app), fake


def test_health_turns_503_when_the_loop_dies() -> None:
    client, fake = make_client()
    with client:
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "t1 t2 t3 "
        fake.fail_on_step = True
        dead = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert dead.status_code == 503 and "engine failed" in dead.json()["error"]["message"]
        assert "boom" not in dead.text  # the cause is logged, not shown to clients
        health = client.get("/health")
        assert health.status_code == 503 and "engine stopped" in health.json()["error"]["message"]
        assert health.headers["retry-after"]
        again = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True})
        assert again.status_code == 503


def test_streaming_request_gets_an_in_band_error_when_the_loop_dies() -> None:
    client, fake = make_client()
    with client:
        fake.fail_on_step = True
        response = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3, "stream": True})
        assert response.status_code == 200
        assert '"error"' in response.text and "engine failed" in response.text
        assert response.text.endswith("data: [DONE]\n\n")


def test_openapi_describes_the_bodies_parsed_off_the_loop() -> None:
    """The generation routes read their bodies themselves (request_body.py); the OpenAPI document
    clients and the fuzz test read must still give each body's schema."""
    client, _ = make_client()
    with client:
        document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        body = document["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert "prompt" in schemas["CompletionRequest"]["properties"] and model in schemas
    assert "ChatMessageParam" in schemas  # the schemas the bodies refer to come along
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(document))
    assert refs and not [name for name in refs if name not in schemas]


@pytest.mark.parametrize("value", [0, -1])
def test_the_new_request_bounds_refuse_values_out_of_range(value: int) -> None:
    with pytest.raises(ValueError, match="max_prompts_per_request must be >= 1"):
        ServerSettings(served_model_names=["fake"], max_prompts_per_request=value)
    with pytest.raises(ValueError, match="max_grammar_chars must be a positive integer"):
        LimitsConfig(max_grammar_chars=value)
    with pytest.raises(ValueError, match="max_grammar_chars must be a positive integer"):
        LimitsConfig(max_grammar_chars=True)  # type: ignore[arg-type]
