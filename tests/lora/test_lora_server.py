"""LoRA adapters over HTTP, with the official clients: a request picks an adapter by ``model``
(its output PEFT's), ``/v1/models`` lists adapters with their base as parent, adapters load and
unload while the server runs (behind the API key; bad ones are clear 4xx and the server goes
on), and a request running with an adapter finishes when its adapter is unloaded meanwhile."""

from __future__ import annotations

import os

import anthropic
import httpx
import openai
import pytest

from pagellm.entrypoints.openai import errors as openai_errors
from tests.helpers.lora_adapters import MAX_TOKENS, PROMPTS
from tests.helpers.server import RemoteServer

KEY = "lora-test-key"


@pytest.fixture(scope="module")
def server(tiny_llama_path: str, lora_adapters: dict[str, str]):
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "128", "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"all={lora_adapters['all']}",
            f'{{"name": "qv", "path": "{lora_adapters["qv"]}", "base_model_name": "tiny"}}',
            "--allow-runtime-lora-updating"]  # fmt: skip
    with RemoteServer(tiny_llama_path, args, api_key=KEY) as remote:
        yield remote


def _complete(client: openai.OpenAI, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return out.choices[0].text


@pytest.fixture(scope="module")
def texts(references, default_tokenizer) -> dict[str | None, list[str]]:
    """The references as the server's text."""
    return {name: [default_tokenizer.decode(tokens) for tokens in refs] for name, refs in references.items()}


def _post(server: RemoteServer, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url(path), json=body, headers=headers, timeout=60)


def test_models_list_adapters_with_their_base(server):
    models = {m.id: m for m in server.client().models.list().data}
    assert set(models) >= {"tiny", "all", "qv"}
    assert models["all"].parent == "tiny" and models["qv"].parent == "tiny" and models["tiny"].parent is None


def test_a_request_runs_with_the_adapter_its_model_names(server, texts):
    client = server.client()
    for name in ("all", "qv"):
        assert _complete(client, name, PROMPTS[0]) == texts[name][0], name
    assert _complete(client, "tiny", PROMPTS[1]) == texts[None][1]
    chat = client.chat.completions.create(model="qv", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "qv" and chat.choices[0].message.content is not None
    message = server.anthropic_client().messages.create(model="all", max_tokens=3,
                                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert message.model == "all" and message.content
    vectors = {name: client.embeddings.create(model=name, input="hello there").data[0].embedding for name in ("tiny", "all")}
    assert vectors["tiny"] != vectors["all"]  # an embedding pools the adapter's hidden states


def test_adapters_load_and_unload_at_run_time(server, texts, lora_adapters, tmp_path):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp0", prompt="x", max_tokens=1)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "mlp0", "lora_path": lora_adapters["mlp0"]},
                 key=None).status_code == 401  # fmt: skip
    loaded = _post(server, "/v1/load_lora_adapter", {"lora_name": "mlp0", "lora_path": lora_adapters["mlp0"]})
    assert loaded.status_code == 200, loaded.text
    assert _complete(client, "mlp0", PROMPTS[1]) == texts["mlp0"][1]
    again = _post(server, "/v1/load_lora_adapter", {"lora_name": "mlp0", "lora_path": lora_adapters["qv"]})
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_name_in_use"
    os.makedirs(tmp_path / "pickled")
    (tmp_path / "pickled" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")
    for path, match in ((str(tmp_path / "nowhere"), "is not a folder"), (str(tmp_path / "pickled"), "pickle")):
        bad = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert bad.status_code == 400 and match in bad.json()["error"]["message"]
    unloaded = _post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp0"})
    assert unloaded.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp0", prompt="x", max_tokens=1)
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp0"}).status_code == 404
    hostile = [{"lora_name": "x" * 100_000, "lora_path": lora_adapters["qv"]}, {"lora_name": 7, "lora_path": []},
               {"lora_name": "deep", "lora_path": {"a": [[[[[[]]]]]]}}, {"lora_name": "n\x00", "lora_path": "\x00/etc"},
               {"lora_name": "x", "lora_path": "p" * 100_000}, {}]  # fmt: skip
    for body in hostile:
        assert _post(server, "/v1/load_lora_adapter", body).status_code == 400, body
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": ["all"]}).status_code == 400
    assert _complete(client, "all", PROMPTS[0]) == texts["all"][0]  # the server goes on


def test_a_running_request_finishes_when_its_adapter_is_unloaded(server, texts, lora_adapters):
    client = server.client()
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": lora_adapters["qv"]}).status_code == 200
    stream = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)  # the request is running with the adapter
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == texts["qv"][0]


def test_anthropic_clients_get_their_error_shape_for_an_unknown_adapter(server):
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic_client().messages.create(model="nope", max_tokens=3, messages=[{"role": "user", "content": "x"}])


def test_lora_module_entries_and_server_settings_are_checked():
    from pagellm.entrypoints.openai.api_server import ServerSettings
    from pagellm.entrypoints.openai.serving_models import LoRAModule, ServedModels

    assert LoRAModule.parse("sql=/a/b=c") == LoRAModule("sql", "/a/b=c")
    assert LoRAModule.parse('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModule("x", "/p", "m")
    for bad in ("sql", "=/p", "sql=", '{"name": "x"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            LoRAModule.parse(bad)
    with pytest.raises(ValueError, match="need --enable-lora"):
        ServerSettings(served_model_names=["m"], lora_modules=[LoRAModule("x", "/p")])
    served = ServedModels(["m"])  # LoRA off: adapters are refused, the base name resolves
    assert served.resolve(None) == ("m", None) and served.resolve("m") == ("m", None)
    with pytest.raises(openai_errors.BadRequestError, match="LoRA adapters are off"):
        served.add("x", "/p")


def test_metrics_name_the_running_and_waiting_adapters():
    """vLLM's ``lora_requests_info``: only where LoRA is on; per replica under data parallelism."""
    from pagellm.engine.data_parallel import combined_stats
    from pagellm.engine.protocol import EngineStats
    from pagellm.metrics.prometheus import PrometheusMetrics

    one = EngineStats(max_loras=2, lora_running={"b": 1, "a": 2}, lora_waiting={"c": 1})
    text = PrometheusMetrics("m", stats=lambda: one).render()[0].decode()
    line = next(line for line in text.splitlines() if line.startswith("pagellm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="a,b"' in line and 'waiting_lora_adapters="c"' in line
    assert "lora_requests_info{" not in PrometheusMetrics("m", stats=EngineStats).render()[0].decode()
    two = EngineStats(max_loras=2, lora_running={"a": 1, "d": 1})
    total = combined_stats([one, two])
    assert total.lora_running == {"a": 3, "b": 1, "d": 1} and total.max_loras == 2
