"""Mamba-2 (Granite-4.0-H): the chunked scan equal to the token-by-token recurrence it stands
for, and the family's config read (or refused) by name. Engine runs against transformers:
tests/engine/test_engine_vs_hf.py and test_hybrid.py."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.mamba2 import ssd_scan
from pagellm.model.mamba_shape import MAMBA, granite_hybrid_config


def recurrence(x, dt, a, b, c, state):
    """The reference: h_t = exp(dt_t a) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, one token at a time."""
    outputs = []
    for t in range(x.shape[0]):
        state = state * torch.exp(dt[t] * a)[:, None, None] + (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        outputs.append(torch.einsum("hpn,hn->hp", state, c[t]))
    return torch.stack(outputs), state


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_the_chunked_scan_equals_the_recurrence(chunk_size: int) -> None:
    """19 tokens (chunks that do not divide them), 4 heads of 5 channels, a 6-wide state, from a
    state that is not zero: every output and the final state."""
    g = torch.Generator().manual_seed(0)
    tokens, heads, head_dim, size = 19, 4, 5, 6
    x = torch.randn(tokens, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(tokens, heads, generator=g, dtype=torch.float64) * 0.5
    a = -torch.rand(heads, generator=g, dtype=torch.float64)
    b, c = (torch.randn(tokens, heads, size, generator=g, dtype=torch.float64) for _ in range(2))
    state = torch.randn(heads, head_dim, size, generator=g, dtype=torch.float64)
    expected_y, expected_state = recurrence(x, dt, a, b, c, state)
    y, final = ssd_scan(x, dt, a, b, c, state, chunk_size)
    torch.testing.assert_close(y, expected_y)
    torch.testing.assert_close(final, expected_state)


def hub_config(**overrides) -> dict:
    """A Granite-4.0-H Micro-like config.json as the Hub spells it ("mamba" / "attention")."""
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "shared_intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "layer_types": ["mamba", "attention", "mamba"], "num_local_experts": 0,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "position_embedding_type": "nope", "residual_multiplier": 0.25,
        "time_step_limit": [0.0, "Infinity"],
    }  # fmt: skip
    return {**config, **overrides}


def test_a_hub_config_is_read() -> None:
    arch = ModelArchConfig.from_hf_config(hub_config())
    assert arch.layer_types == (MAMBA, "full_attention", MAMBA)
    assert (arch.mamba_layers, arch.recurrent_layers, arch.num_attention_layers) == ((0, 2), (0, 2), 1)
    assert arch.intermediate_size == 96 and arch.residual_multiplier == 0.25
    assert arch.nope_layers == (0, 1, 2)  # position_embedding_type "nope": no rope anywhere
    assert arch.mamba is not None and (arch.mamba.inner_size, arch.mamba.conv_dim, arch.mamba.in_proj_size) == (
        128, 160, 296)  # fmt: skip
    assert arch.mamba.dt_max == math.inf
    rope = ModelArchConfig.from_hf_config(hub_config(position_embedding_type="rope"))
    assert rope.nope_layers == ()


def test_routed_experts_beside_the_shared_mlp() -> None:
    """H Tiny's layout: every layer a mixture of experts ``intermediate_size`` wide, its shared
    MLP ``shared_intermediate_size`` wide beside them, the chosen logits softmaxed in float32."""
    arch = ModelArchConfig.from_hf_config(hub_config(num_local_experts=64, num_experts_per_tok=6))
    assert (arch.moe_layers, arch.num_experts, arch.num_experts_per_tok) == ((0, 1, 2), 64, 6)
    assert (arch.moe_intermediate_size, arch.shared_expert_size, arch.moe_scoring) == (128, 96, "topk_softmax_float32")


@pytest.mark.parametrize("limit", [[0.0, {"__float__": "Infinity"}], [0.001, 100], None])
def test_the_time_step_limit_in_each_spelling(limit) -> None:
    """transformers writes an infinite limit as {"__float__": "Infinity"}; JSON files as a number."""
    _, shape = granite_hybrid_config(hub_config(time_step_limit=limit))
    assert (shape.dt_min, shape.dt_max) == ((0.0, math.inf) if limit is None or limit[0] == 0.0 else (0.001, 100.0))


@pytest.mark.parametrize(("overrides", "words"), [
    ({"layer_types": ["mamba", "moe", "mamba"]}, r"layer types \['moe'\]"),
    ({"mamba_d_head": 12}, "mamba_n_heads .8. x mamba_d_head .12."),
    ({"mamba_n_groups": 3}, "mamba_n_groups .3. must divide"),
])  # fmt: skip
def test_what_cannot_run_is_refused_by_name(overrides: dict, words: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=words):
        ModelArchConfig.from_hf_config(hub_config(**overrides))


def test_mamba_layers_of_another_family_are_refused() -> None:
    """A Mamba layer type outside Granite-4.0-H has no shape to run: refused, never guessed."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "layer_types": ["mamba", "full_attention"]}  # fmt: skip
    with pytest.raises(NotImplementedError, match="Mamba layers are not supported"):
        ModelArchConfig.from_hf_config(config)
