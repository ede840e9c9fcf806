"""Random-weight files of real shapes (benchmarks.random_gguf) and the decode floor's byte counts
(benchmarks.floor), on a small shape of the same families: the GGUF holds llama-quantize's type
mix, its tensors load back (names, q/k permutation) as the same weights as the safetensors
folder, and the bytes a token reads are counted from the file and from the loaded model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from pagellm.benchmarks import floor
from pagellm.benchmarks.gguf_encode import encode
from pagellm.benchmarks.random_gguf import checkpoint_tensors, random_tensor, write_random_gguf
from pagellm.model.gguf_loader import open_gguf

# A Llama-3-8B-like layout at a test's size: untied, GQA, 8 layers (so use_more_bits picks some),
# the default tokenizer's vocabulary padded to 49,408.
SMALL_LLAMA = dict(
    architecture="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, vocab_size=49408, max_position_embeddings=1024, rms_norm_eps=1e-5,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


@pytest.fixture(scope="module")
def small_q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("random-gguf") / "small-q4_k_m.gguf"
    write_random_gguf(path, SMALL_LLAMA, "Q4_K_M", seed=3)
    return str(path)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q8_0])
def test_encoders_write_blocks_gguf_py_reads_back(qtype: T) -> None:
    weight = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32) * 0.02
    decoded = dequantize(encode(weight, qtype), qtype).reshape(weight.shape)
    bits = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6, T.Q4_0: 4, T.Q8_0: 8}[qtype]
    # Round to nearest: within one step of a sub-block's range (2^bits - 1 steps over it), plus
    # the 6-bit scale's rounding for the K types.
    assert np.abs(decoded - weight).max() <= 2.5 * np.abs(weight).max() / (2**bits - 1)


def test_q4_k_m_holds_llama_quantizes_type_mix(small_q4_k_m: str) -> None:
    types = {t.name: t.tensor_type for t in open_gguf(small_q4_k_m).tensors}
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    # use_more_bits(i, 8): i < 1, i >= 7, (i - 1) % 3 == 2 -> layers 0, 3, 6, 7
    more = {0, 3, 6, 7}
    for i in range(8):
        for name in ("attn_v", "ffn_down"):
            assert types[f"blk.{i}.{name}.weight"] == (T.Q6_K if i in more else T.Q4_K), (i, name)
        assert types[f"blk.{i}.attn_q.weight"] == T.Q4_K and types[f"blk.{i}.attn_norm.weight"] == T.F32


def test_gguf_loads_back_as_the_checkpoint_weights(small_q4_k_m: str, tmp_path) -> None:
    """pagellm's GGUF reader (names mapped back, q/k rows unpermuted) sees the weights the
    safetensors writer writes for the same seed, up to the file's quantization."""
    from pagellm.model.arch_config import ModelArchConfig
    from pagellm.model.gguf_loader import arch_config_from_gguf, iter_gguf_weights

    path = tmp_path / "small-q8_0.gguf"
    write_random_gguf(path, SMALL_LLAMA, "Q8_0", seed=3)
    reader = open_gguf(str(path))
    arch: ModelArchConfig = arch_config_from_gguf(reader)
    assert (arch.hidden_size, arch.num_hidden_layers, arch.vocab_size) == (256, 8, 49408)
    loaded = dict(iter_gguf_weights(reader, arch))
    specs = checkpoint_tensors(SMALL_LLAMA)
    assert set(loaded) == {spec.name for spec in specs}
    for spec in specs:
        expected = random_tensor(spec, seed=3)
        assert torch.allclose(loaded[spec.name].float(), expected, atol=float(expected.abs().max()) / 100), spec.name


def test_file_bytes_per_token_count_one_embedding_row_unless_tied(small_q4_k_m: str, tmp_path) -> None:
    tensors = {t.name: t.data.nbytes for t in open_gguf(small_q4_k_m).tensors}
    row = tensors["token_embd.weight"] // SMALL_LLAMA["vocab_size"]
    assert floor.gguf_bytes_per_token(small_q4_k_m) == sum(tensors.values()) - tensors["token_embd.weight"] + row
    tied = tmp_path / "tied.gguf"
    write_random_gguf(tied, dict(SMALL_LLAMA, tie_word_embeddings=True, num_hidden_layers=1), "Q4_0")
    tied_tensors = {t.name: (t.tensor_type, t.data.nbytes) for t in open_gguf(str(tied)).tensors}
    assert "output.weight" not in tied_tensors and tied_tensors["token_embd.weight"][0] == T.Q6_K
    assert floor.gguf_bytes_per_token(str(tied)) == sum(size for _, size in tied_tensors.values())


def test_pagellm_reads_the_files_bytes_of_its_linears(small_q4_k_m: str) -> None:
    """The loaded model's weight bytes a token counted the same way as the file's: every linear
    and norm once, one embedding row; pagellm's packed Q4_K and Q6_K hold the file's bits (its
    norms, bf16 against the file's float32, are all that differ here)."""
    from pagellm import LLM

    llm = LLM(model=small_q4_k_m, max_model_len=256, num_kv_blocks=32)
    model = llm.llm_engine.executor.model_runner.model
    ours, file_bytes = floor.decode_weight_bytes(model), floor.gguf_bytes_per_token(small_q4_k_m)
    norms = 2 * SMALL_LLAMA["num_hidden_layers"] + 1
    assert ours == file_bytes - norms * SMALL_LLAMA["hidden_size"] * 2
    norm = model.model.norm.weight
    assert floor.decode_weight_bytes(model.model.norm) == norm.numel() * norm.element_size()
    embedding = model.model.embed_tokens  # rows left in the file: one row as stored
    assert embedding.rows is not None and embedding.rows.format == "q4k"
    assert floor.decode_weight_bytes(embedding) == SMALL_LLAMA["hidden_size"] // 256 * 144


def test_safetensors_folder_holds_the_same_weights_in_shards(tmp_path, monkeypatch) -> None:
    import json

    from safetensors import safe_open

    from pagellm.benchmarks import random_gguf

    monkeypatch.setattr(random_gguf, "_SHARD_BYTES", 8 << 20)  # several shards at a test's size
    shape = dict(SMALL_LLAMA, num_hidden_layers=2)
    folder = random_gguf.write_random_safetensors(tmp_path / "small", shape, torch.bfloat16, seed=3)
    index = json.loads((tmp_path / "small" / "model.safetensors.index.json").read_text())["weight_map"]
    specs = checkpoint_tensors(shape)
    assert set(index) == {spec.name for spec in specs} and len(set(index.values())) > 1
    for spec in specs:
        with safe_open(f"{folder}/{index[spec.name]}", "pt") as f:
            assert torch.equal(f.get_tensor(spec.name), random_tensor(spec, seed=3).to(torch.bfloat16)), spec.name
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == shape["vocab_size"]
    # padded in the BPE vocabulary, not as added tokens (each load would deep-copy them)
    assert len(tokenizer.added_tokens_decoder) < 100 and tokenizer.decode([shape["vocab_size"] - 1]).startswith("<pad_")
