"""The scan layers, Mamba-2 (Granite-4.0-H) and the gated delta-net (Qwen3.5): each chunked
scan equal to the token-by-token recurrence it stands for, and the families' configs read (or
refused) by name. Engine runs against transformers: tests/engine/test_engine_vs_hf.py and
test_hybrid.py."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.delta_net import delta_scan
from pagellm.model.mamba2 import ssd_scan
from pagellm.model.scan_shapes import DELTA_NET, MAMBA, granite_hybrid_config


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
    ({"mamba_n_heads": -8, "mamba_d_head": -16}, "mamba_n_heads must be a positive integer, got -8"),
    ({"mamba_d_state": "huge"}, "mamba_d_state must be a positive integer, got 'huge'"),
    ({"mamba_d_conv": 2.5}, "mamba_d_conv must be a positive integer, got 2.5"),
    ({"time_step_limit": [0.0]}, r"time_step_limit must be two numbers, got \[0.0\]"),
    ({"time_step_limit": {"low": 1}}, "time_step_limit must be two numbers"),
    ({"time_step_limit": [5.0, 1.0]}, r"low <= high, got \[5.0, 1.0\]"),
    ({"mamba_d_head": 12}, "mamba_n_heads .8. x mamba_d_head .12."),
    ({"mamba_n_groups": 3}, "mamba_n_groups .3. must divide"),
])  # fmt: skip
def test_what_cannot_run_is_refused_by_name(overrides: dict, words: str) -> None:
    with pytest.raises((ValueError, NotImplementedError), match=words):
        ModelArchConfig.from_hf_config(hub_config(**overrides))


@pytest.mark.parametrize(("layer_type", "words"), [(MAMBA, "Mamba layers are not supported"),
                                                   (DELTA_NET, "linear_attention layers are not supported")])
def test_scan_layers_of_another_family_are_refused(layer_type: str, words: str) -> None:
    """A scan layer type outside the families that define its shape: refused, never guessed."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "layer_types": [layer_type, "full_attention"]}  # fmt: skip
    with pytest.raises(NotImplementedError, match=words):
        ModelArchConfig.from_hf_config(config)


def delta_recurrence(q, k, v, g, beta, state):
    """The reference: decay, correct toward v where k reads (the delta rule), read with q."""
    outputs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, None, None]
        read = torch.einsum("hd,hdv->hv", k[t], state)
        state = state + k[t][..., None] * ((v[t] - read) * beta[t][:, None])[:, None, :]
        outputs.append(torch.einsum("hd,hdv->hv", q[t], state))
    return torch.stack(outputs), state


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
def test_the_chunked_delta_rule_equals_the_recurrence(chunk_size: int) -> None:
    """19 tokens, 3 heads, keys of 4 and values of 5 dims (L2-normed keys, as the layer feeds
    it), from a state that is not zero: every output and the final state."""
    gen = torch.Generator().manual_seed(1)
    tokens, heads = 19, 3
    q, k = (torch.nn.functional.normalize(torch.randn(tokens, heads, 4, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))  # fmt: skip
    v = torch.randn(tokens, heads, 5, generator=gen, dtype=torch.float64)
    g = -torch.rand(tokens, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(tokens, heads, generator=gen, dtype=torch.float64)
    state = torch.randn(heads, 4, 5, generator=gen, dtype=torch.float64)
    expected_out, expected_state = delta_recurrence(q, k, v, g, beta, state)
    out, final = delta_scan(q, k, v, g, beta, state, chunk_size)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(final, expected_state)


def qwen3_5_arch() -> ModelArchConfig:
    text = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "vocab_size": 1000, "full_attention_interval": 4,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True}}  # fmt: skip
    return ModelArchConfig.from_hf_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                                           "tie_word_embeddings": True})  # fmt: skip


@pytest.mark.parametrize(("key", "value"), [("linear_num_key_heads", 0), ("linear_value_head_dim", -128),
                                            ("linear_conv_kernel_dim", [4]), ("linear_num_value_heads", 4.5)])
def test_a_qwen3_5_delta_net_shape_out_of_range_is_named(key: str, value: object) -> None:
    """(A text model's config.json, read as it is: a multimodal one's goes through transformers'
    config class, which refuses wrong types itself.)"""
    config = {"architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
              "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 1000, key: value}  # fmt: skip
    with pytest.raises(ValueError, match=f"{key} must be a positive integer"):
        ModelArchConfig.from_hf_config(config)


def test_a_multimodal_qwen3_5_config_serves_its_text_model() -> None:
    """Qwen3.5's checkpoints are multimodal: the text model's config from ``text_config``
    (transformers' defaults filled in), the wrapper's tie flag."""
    arch = qwen3_5_arch()
    assert arch.architecture == "Qwen3_5ForCausalLM" and arch.tie_word_embeddings
    assert arch.layer_types == (DELTA_NET, DELTA_NET, DELTA_NET, "full_attention")
    assert arch.delta_net_layers == (0, 1, 2) and arch.rotary_dim == 4 and arch.rope_scaling is None
    assert arch.norm_unit_offset and arch.attn_output_gate and arch.qk_norm
    assert arch.delta_net is not None and arch.delta_net.state_shapes() == ((3, 96), (4, 8, 16))  # (q, k: 2 x 8; v: 4 x 16)
    assert not arch.snapshots_states_per_block


def test_a_multimodal_qwen3_5_checkpoints_tensors_by_the_text_models_names() -> None:
    """Its text model's tensors under ``model.language_model``, the vision tower's and the
    multi-token-prediction layer's dropped, each head's query and output gate split out of q_proj."""
    from pagellm.model.weight_names import checkpoint_parts

    arch = qwen3_5_arch()
    conv = torch.zeros(96, 1, 4)
    assert [n for n, _ in checkpoint_parts(arch, "model.language_model.layers.0.linear_attn.conv1d.weight", conv)] == [
        "model.layers.0.linear_attn.conv_weight"]  # fmt: skip
    assert checkpoint_parts(arch, "model.visual.blocks.0.attn.qkv.weight", conv) == []
    assert checkpoint_parts(arch, "mtp.fc.weight", conv) == []
    rows = torch.arange(2 * 4 * 16, dtype=torch.float32)[:, None].expand(-1, 64)  # row r holds r
    parts = dict(checkpoint_parts(arch, "model.language_model.layers.3.self_attn.q_proj.weight", rows))
    query, gate = parts["model.layers.3.self_attn.q_proj.weight"], parts["model.layers.3.self_attn.g_proj.weight"]
    assert query[:, 0].tolist() == [h * 32 + d for h in range(4) for d in range(16)]
    assert gate[:, 0].tolist() == [h * 32 + 16 + d for h in range(4) for d in range(16)]


@pytest.mark.parametrize("indices", [[9], [-1], ["2"], [True], "2", [1.5]])
def test_bamba_attention_layers_out_of_range_are_refused(indices: object) -> None:
    config = {**hub_config(), "architectures": ["BambaForCausalLM"], "attn_layer_indices": indices}
    with pytest.raises(ValueError, match="attn_layer_indices must list layers below num_hidden_layers"):
        ModelArchConfig.from_hf_config(config)


def test_bamba_layer_types_from_its_attention_indices() -> None:
    config = {**hub_config(), "architectures": ["BambaForCausalLM"], "attn_layer_indices": [1], "mamba_d_head": 16}
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.layer_types == (MAMBA, "full_attention", MAMBA) and arch.mamba is not None
