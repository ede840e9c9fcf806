"""Embeddings (``LLM.embed``): equal to transformers' final hidden states pooled the same way,
through chunked prefill, preemption and the prefix cache, beside generation in one engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagellm import LLM, PoolingParams, SamplingParams
from pagellm.engine.protocol import EngineRequest
from pagellm.model.pooler_defaults import model_pooler_config
from pagellm.pooler_config import PoolerConfig

PROMPTS = ["The capital of France is Paris, and the capital of Italy is", "hello " * 37, "a"]
ATOL = 2e-5


def _sentence_transformers_folder(base: str, folder: Path, mode: str, normalize: bool, **config: object) -> str:
    """A copy of a tiny model with sentence-transformers' pooling files (and config.json extras)."""
    shutil.copytree(base, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}
    pooling = {key: key == modes[mode] for key in modes.values()} | {"word_embedding_dimension": 64}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    hf_config = json.loads((folder / "config.json").read_text()) | config
    (folder / "config.json").write_text(json.dumps(hf_config))
    return str(folder)


@pytest.fixture(scope="module")
def embed_model(tiny_qwen3_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Qwen3 as a Qwen3-Embedding-style checkpoint: last token, normalized, matryoshka."""
    return _sentence_transformers_folder(tiny_qwen3_path, tmp_path_factory.mktemp("emb") / "m", "LAST", True,
                                         is_matryoshka=True)  # fmt: skip


@pytest.fixture(scope="module")
def hidden_states(tiny_qwen3_path: str, default_tokenizer) -> dict[str, torch.Tensor]:
    """transformers' final-normed hidden states [T, hidden] of each prompt, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    states = {}
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = default_tokenizer(prompt).input_ids
            states[prompt] = model(torch.tensor([ids])).last_hidden_state[0]
    return states


def _reference(states: torch.Tensor, kind: str, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    vector = {"LAST": states[-1], "MEAN": states.mean(dim=0), "CLS": states[0]}[kind]
    vector = vector[:dimensions] if dimensions else vector
    return F.normalize(vector, dim=-1) if normalize else vector


def _embed(llm: LLM, prompts: list[str], params: PoolingParams | None = None) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, params, use_tqdm=False)]


def test_model_files_choose_the_pooler(embed_model: str, tiny_qwen3_path: str) -> None:
    assert model_pooler_config(embed_model) == PoolerConfig("LAST", True, True, None)
    assert model_pooler_config(tiny_qwen3_path) == PoolerConfig()  # nothing declared: the defaults apply


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_equal_to_transformers_through_chunks(embed_model, hidden_states, kind: str) -> None:
    """Prompts longer than a step's budget are pooled over their chunks; unnormalized by the flag."""
    llm = LLM(embed_model, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64,
              pooler_config={"pooling_type": kind, "normalize": False})  # fmt: skip
    for prompt, vector in zip(PROMPTS, _embed(llm, PROMPTS)):
        torch.testing.assert_close(vector, _reference(hidden_states[prompt], kind, False), atol=ATOL, rtol=1e-4)


def test_normalized_matryoshka_dimensions(embed_model, hidden_states) -> None:
    llm = LLM(embed_model, dtype="float32", num_kv_blocks=64)
    (full,) = _embed(llm, PROMPTS[:1])
    torch.testing.assert_close(full, _reference(hidden_states[PROMPTS[0]], "LAST", True), atol=ATOL, rtol=1e-4)
    assert full.norm().item() == pytest.approx(1.0, abs=1e-5)
    (cut,) = _embed(llm, PROMPTS[:1], PoolingParams(dimensions=16))
    torch.testing.assert_close(cut, _reference(hidden_states[PROMPTS[0]], "LAST", True, 16), atol=ATOL, rtol=1e-4)
    (raw,) = _embed(llm, PROMPTS[:1], PoolingParams(normalize=False))
    torch.testing.assert_close(raw, _reference(hidden_states[PROMPTS[0]], "LAST", False), atol=ATOL, rtol=1e-4)
    with pytest.raises(ValueError, match="dimensions must be at most 64"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=65), use_tqdm=False)


def test_dimensions_refused_where_the_model_is_not_matryoshka(tiny_qwen3_path) -> None:
    llm = LLM(tiny_qwen3_path, dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    assert len(llm.embed("hi", PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.parse('{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="unknown keys"):
        PoolerConfig.parse({"pooling": "LAST"})


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_prefix_cache(embed_model, hidden_states, kind: str) -> None:
    """A repeated prompt: LAST reads the cached prefix, MEAN computes every token again (the cache
    holds K/V, not hidden states)."""
    llm = LLM(embed_model, dtype="float32", num_kv_blocks=64, block_size=4, pooler_config={"pooling_type": kind})
    for _ in range(2):
        (vector,) = _embed(llm, PROMPTS[1:2])
        torch.testing.assert_close(vector, _reference(hidden_states[PROMPTS[1]], kind, True), atol=ATOL, rtol=1e-4)
    assert (llm.llm_engine.stats.prefix_cache_hits > 0) == (kind == "LAST")


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_preempted_mid_prompt_pools_the_same(embed_model, hidden_states, kind: str) -> None:
    """A generating request outgrows a small pool and preempts embeddings in the middle of their
    chunked prompts: recomputed from the start, they pool as if never preempted."""
    llm = LLM(embed_model, dtype="float32", num_kv_blocks=14, block_size=4, max_num_batched_tokens=16,
              pooler_config={"pooling_type": kind})  # fmt: skip
    engine = llm.llm_engine
    ids = [engine.input_processor.process_prompt(p).prompt_token_ids for p in PROMPTS[:2]]
    engine.add_engine_request(EngineRequest("g", ids[0], SamplingParams(max_tokens=30, ignore_eos=True), stream=False))
    for i in range(2):
        engine.add_engine_request(EngineRequest(f"e{i}", ids[1], PoolingParams()))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.stats.num_preemptions > 0, "the small pool was meant to force preemption"
    for i in range(2):
        expected = _reference(hidden_states[PROMPTS[1]], kind, True)
        torch.testing.assert_close(torch.tensor(finished[f"e{i}"].embedding), expected, atol=ATOL, rtol=1e-4)


def test_embeddings_beside_generation(embed_model) -> None:
    """One engine, one batch: generation's tokens are the same as alone, embeddings as alone."""
    llm = LLM(embed_model, dtype="float32", num_kv_blocks=64)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone_text = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0].token_ids
    alone_vectors = _embed(llm, PROMPTS)
    engine = llm.llm_engine
    ids = [engine.input_processor.process_prompt(p).prompt_token_ids for p in PROMPTS]
    engine.add_engine_request(EngineRequest("g", ids[0], greedy, stream=False))
    for i, prompt_ids in enumerate(ids):
        engine.add_engine_request(EngineRequest(f"e{i}", prompt_ids, PoolingParams()))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["g"].outputs[0].token_ids == alone_text and finished["g"].embedding is None
    for i, vector in enumerate(alone_vectors):
        assert finished[f"e{i}"].outputs[0].token_ids == []
        torch.testing.assert_close(torch.tensor(finished[f"e{i}"].embedding), vector, atol=1e-6, rtol=1e-5)


def test_default_gguf_model_embeds() -> None:
    """The default model (a chat model, no pooler files): its last token, normalized."""
    llm = LLM(None, num_kv_blocks=64)
    vectors = _embed(llm, ["The capital of France is Paris.", "Paris is the capital of France.", "Bananas are yellow."])
    assert [v.shape[0] for v in vectors] == [576] * 3
    assert all(v.norm().item() == pytest.approx(1.0, abs=1e-4) for v in vectors)


def test_a_gguf_file_says_how_it_pools(tmp_path: Path) -> None:
    """llama.cpp's converter writes an embedding model's pooling as ``{arch}.pooling_type``."""
    from gguf import GGUFWriter

    for code, kind in ((1, "MEAN"), (2, "CLS"), (3, "LAST"), (None, None)):
        path = tmp_path / f"p{code}.gguf"
        writer = GGUFWriter(str(path), "qwen3")
        if code is not None:
            writer.add_uint32("qwen3.pooling_type", code)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert model_pooler_config(str(path)).pooling_type == kind


def test_a_vector_that_is_not_finite_fails_its_request_alone() -> None:
    """An overflow in the hidden states: that request fails (named), the others get their vectors."""
    from pagellm.pooling_params import Pooling
    from pagellm.step import NewSequence, SchedulerOutput
    from pagellm.worker.pooler import PoolChunk, Pooler

    pooler = Pooler()
    pooler.apply(SchedulerOutput([], new_sequences=[
        NewSequence(s, [1, 2], 2, SamplingParams(max_tokens=1), Pooling("MEAN", True)) for s in ("a", "b")]))  # fmt: skip
    hidden = torch.tensor([[1.0, 2.0], [3.0, 4.0], [float("inf"), 0.0], [1.0, 1.0]])
    failed: dict[str, str] = {}
    vectors = pooler.pool(hidden, [PoolChunk("a", 0, 0, 2, True), PoolChunk("b", 0, 2, 4, True)], failed)
    assert set(vectors) == {"a"} and "not finite" in failed["b"]
    torch.testing.assert_close(torch.tensor(vectors["a"]), F.normalize(torch.tensor([2.0, 3.0]), dim=-1))
