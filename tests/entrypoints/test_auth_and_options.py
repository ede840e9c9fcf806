"""A server with --api-key, --served-model-name and a --chat-template override."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)


@pytest.fixture(scope="module")
def secured(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--served-model-name", "my-model", "--chat-template", str(template), "--num-kv-blocks", "64"]
    with RemoteServer(tiny_llama_path, args, api_key=KEY) as remote:
        yield remote


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
)
def test_missing_or_wrong_key_is_401(secured: RemoteServer, headers: dict[str, str]) -> None:
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("POST", "/v1/chat/completions", {"messages": []}),
        ("POST", "/tokenize", {"prompt": "x"}),
    ]:
        response = httpx.request(method, secured.url(path), json=body, headers=headers, timeout=30)
        assert response.status_code == 401, path
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "API key" in error["message"]
    good = httpx.post(secured.url("/v1/completions"), json={"prompt": "x", "max_tokens": 1},
                      headers=secured.headers, timeout=30)
    assert good.status_code == 200


def test_health_and_metrics_need_no_key(secured: RemoteServer) -> None:
    assert httpx.get(secured.url("/health")).status_code == 200
    assert httpx.get(secured.url("/metrics")).status_code == 200


def test_openai_client_with_key(secured: RemoteServer) -> None:
    with secured.client() as client:
        assert [m.id for m in client.models.list().data] == ["my-model"]
        result = client.completions.create(model="my-model", prompt="Hi", max_tokens=2)
        assert result.model == "my-model"
    with openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key="bad", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_served_name_replaces_path(secured: RemoteServer) -> None:
    response = httpx.post(secured.url("/v1/completions"), headers=secured.headers, timeout=30,
                          json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert response.status_code == 404


def test_chat_template_override(secured: RemoteServer) -> None:
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"}]
    tokens = httpx.post(secured.url("/tokenize"), json={"messages": messages}, headers=secured.headers).json()
    text = httpx.post(secured.url("/detokenize"), json={"tokens": tokens["tokens"]}, headers=secured.headers).json()
    assert text["prompt"] == "[SYSTEM] Be kind.\n[USER] Hello\n[ASSISTANT] "
    with secured.client() as client:
        result = client.chat.completions.create(model="my-model", messages=messages, max_tokens=2)
        assert result.usage.prompt_tokens == tokens["count"]
