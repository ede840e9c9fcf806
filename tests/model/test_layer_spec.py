"""A layer described once: the specs each family's config gives, and what the one-call decoder
stack refuses by name (the rest of each spec it runs, checked against the modules bit for bit in
test_quantized_model.py)."""

from __future__ import annotations

import pytest

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layer_spec import layer_specs, stack_refusal

BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=128)


def _specs(architecture: str, **extra: object):
    return layer_specs(ModelArchConfig.from_hf_config({"architectures": [architecture], **BASE, **extra}))


def test_qwen3_layer_types_give_each_layer_its_window() -> None:
    """transformers writes Qwen's ``max_window_layers`` as ``layer_types``: the window where they
    say so, none elsewhere; every Qwen3 layer norms its q and k heads."""
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    specs = _specs("Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True, layer_types=types)
    assert [s.window for s in specs] == [None, 8, 8] and all(s.qk_norm for s in specs)
    assert [stack_refusal(s) for s in specs] == [None, None, None]


@pytest.mark.parametrize("types, error", [
    (["full_attention", "linear_attention", "full_attention"], NotImplementedError),
    (["full_attention"], ValueError),
])
def test_layer_types_the_engine_cannot_run_are_refused(types: list[str], error: type[Exception]) -> None:
    with pytest.raises(error, match="layer"):
        _specs("Qwen3ForCausalLM", sliding_window=8, layer_types=types)


@pytest.mark.parametrize("architecture, extra, refusal", [
    ("LlamaForCausalLM", {}, None),
    ("LlamaForCausalLM", {"attention_bias": True}, "a bias on o_proj or the MLP"),
    ("Qwen2ForCausalLM", {}, None),  # q/k/v bias: in the call
    ("MistralForCausalLM", {"sliding_window": 8}, None),
    ("Gemma2ForCausalLM", {"attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16}, "norms around each block"),
    ("Olmo2ForCausalLM", {}, "norms around each block"),
    ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}, None),  # partial rotary: in the call
    ("GraniteForCausalLM", {"residual_multiplier": 0.2}, None),  # in the call
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8},
     "a mixture of experts"),
    ("LlamaForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}, "the gelu_pytorch_tanh activation"),
])
def test_the_stack_refuses_only_what_it_lacks(architecture: str, extra: dict, refusal: str | None) -> None:
    spec = _specs(architecture, **extra)[0]
    found = stack_refusal(spec)
    assert found == refusal if refusal is None else found is not None and found.startswith(refusal)


def test_gemma_spec_carries_its_scale_and_cap() -> None:
    spec = _specs("Gemma2ForCausalLM", attn_logit_softcapping=50.0, query_pre_attn_scalar=16)[0]
    assert spec.scale == 16**-0.5 and spec.softcap == 50.0 and spec.sandwich_norms and spec.norm_unit_offset
