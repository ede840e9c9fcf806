"""Gemma 2/3 configs as the engine reads them (old and transformers-5 formats), what it refuses,
and the parts of a Gemma layer the fast paths must leave to the modules."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model import load_arch_config
from pagellm.model.arch_config import FULL, SLIDING, ModelArchConfig
from pagellm.model.layers import UnitOffsetRMSNorm

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=8192, sliding_window=512)  # fmt: skip


def test_gemma3_hub_config_without_layer_types() -> None:
    """The format of Gemma 3 checkpoints on the Hub: a pattern, and the local base apart."""
    arch = ModelArchConfig.from_hf_config({
        **BASE, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 3, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
    })  # fmt: skip
    assert arch.layer_types == (SLIDING, SLIDING, FULL) * 2
    assert [arch.layer_window(i) for i in range(3)] == [512, 512, None]
    assert [arch.layer_uses_local_rope(i) for i in range(3)] == [True, True, False]
    assert arch.rope_theta == 1000000.0 and arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.local_rope_theta == 10000.0 and arch.attention_scale == 256**-0.5
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.qk_norm and arch.norm_unit_offset
    assert arch.embedding_scale == 16**0.5 and arch.attn_logit_softcapping is None


def test_gemma2_defaults_alternate_from_a_windowed_first_layer() -> None:
    arch = ModelArchConfig.from_hf_config({**BASE, "architectures": ["Gemma2ForCausalLM"],
                                           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})  # fmt: skip
    assert arch.layer_types == (SLIDING, FULL) * 3
    assert arch.attn_logit_softcapping == 50.0 and arch.final_logit_softcapping == 30.0
    assert arch.local_rope_theta is None and not arch.qk_norm and arch.sandwich_norms


def test_a_llama_has_no_gemma_fields() -> None:
    arch = ModelArchConfig.from_hf_config({**BASE, "architectures": ["MistralForCausalLM"]})
    assert arch.layer_types == () and arch.layer_window(0) == 512 and not arch.layer_uses_local_rope(0)
    assert not arch.norm_unit_offset and arch.embedding_scale is None and arch.attention_scale is None


def _copy_with(src: str, dst: Path, **changes: object) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("changes,match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "sliding-window layers"),
    (dict(hidden_activation="relu"), "hidden_act 'relu'"),
])  # fmt: skip
def test_what_would_run_wrongly_is_refused(tmp_path: Path, tiny_gemma3_path: str, changes: dict, match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        LLM(_copy_with(tiny_gemma3_path, tmp_path / "gemma3", **changes), dtype="float32")


def test_gemma_norms_scale_by_one_plus_weight() -> None:
    norm = UnitOffsetRMSNorm(4, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.0, 1.0, -1.0, 0.5]))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.tensor([1.0, 2.0, 0.0, 1.5])
    torch.testing.assert_close(norm(x), expected)
    out, residual = norm(x, torch.ones_like(x))  # the residual add before the norm
    torch.testing.assert_close(residual, x + 1)


def test_bf16_gemma_runs_its_layers_as_modules(tiny_gemma2_path: str, caplog: pytest.LogCaptureFixture) -> None:
    """The one-call decoder stack lacks Gemma's norms (it has caps and score scales): a bf16
    Gemma runs its layers as modules, says why once, and tracks float32 (same first token)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=1)
    prompts = [{"prompt_token_ids": list(range(300, 300 + n))} for n in (4, 19)]
    bf16 = LLM(tiny_gemma2_path, dtype="bfloat16")
    with caplog.at_level(logging.INFO, logger="pagellm.model.fused_stack"):
        assert bf16.llm_engine.executor.model_runner.model._decoder_stack() is None
    assert "module by module (layer 0: norms around each block (Gemma's" in caplog.text
    fp32 = LLM(tiny_gemma2_path, dtype="float32")
    for a, b in zip(bf16.generate(prompts, params, use_tqdm=False), fp32.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tiny_gemma3_multimodal_path: str,
                                                           default_tokenizer) -> None:
    """A Gemma 3 4B+ checkpoint (Gemma3ForConditionalGeneration, a text config listing only
    what differs from transformers' defaults): its text model gives transformers' greedy tokens
    on text prompts, the vision tower left unloaded."""
    from transformers import Gemma3ForConditionalGeneration

    from tests.helpers.hf_reference import hf_greedy

    arch = load_arch_config(tiny_gemma3_multimodal_path)
    assert arch.architecture == "Gemma3ForCausalLM" and arch.layer_window(0) == 8 and arch.layer_window(1) is None
    assert arch.head_dim == 16 and arch.vocab_size == len(default_tokenizer)
    hf = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3_multimodal_path, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "In a hole in the ground there lived a hobbit, not a nasty one"]
    ids = [default_tokenizer(p).input_ids for p in prompts]
    expected = [hf_greedy(hf, i, 16) for i in ids]
    llm = LLM(tiny_gemma3_multimodal_path, dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
