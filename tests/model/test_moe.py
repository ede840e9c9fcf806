"""Mixture of experts: routing grouped by expert equals a per-token reference, checkpoints in
either expert layout load alike, and configs the engine would run wrongly are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.moe import SparseMoeBlock
from pagellm.model.registry import validate_arch_config

ARCH = ModelArchConfig(
    architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=None, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, moe_layers=(0,),
)  # fmt: skip


def _per_token_reference(block: SparseMoeBlock, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Each token on its own: softmax, top-k, (renormalise,) the chosen experts' weighted sum."""
    rows = []
    for token in x:
        probs = torch.softmax(block.gate.weight @ token, dim=-1)
        weights, chosen = torch.topk(probs, block.top_k)
        if normalize:
            weights = weights / weights.sum()
        rows.append(sum(w * block.experts[int(e)](token[None])[0] for w, e in zip(weights, chosen)))
    return torch.stack(rows)


@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_experts_equal_each_token_on_its_own(normalize: bool) -> None:
    torch.manual_seed(0)
    arch = ModelArchConfig(**{**ARCH.__dict__, "norm_topk_prob": normalize})
    block = SparseMoeBlock(arch)
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.5)
    x = torch.randn(40, arch.hidden_size)  # more tokens than experts: every expert gets several
    weights, experts = block.route(x)
    assert experts.unique().numel() == arch.num_experts
    torch.testing.assert_close(block(x), _per_token_reference(block, x, normalize), atol=1e-5, rtol=1e-5)
    assert block(x[:0]).shape == (0, arch.hidden_size)  # no rows: nothing routed


def _stack_experts(src: str, dst: Path, num_experts: int) -> None:
    """The checkpoint rewritten in transformers 5's own layout: every expert in one 3-D tensor."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for prefix in sorted({name.split("experts.")[0] for name in tensors if ".experts." in name}):
        parts = {p: [tensors.pop(f"{prefix}experts.{e}.{p}.weight") for e in range(num_experts)]
                 for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        gate_up = [torch.cat([g, u]) for g, u in zip(parts["gate_proj"], parts["up_proj"])]
        tensors[f"{prefix}experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}experts.down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors, str(dst / "model.safetensors"))


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path: Path, tiny_qwen3_moe_path: str) -> None:
    _stack_experts(tiny_qwen3_moe_path, tmp_path / "stacked", num_experts=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 17)]
    per_expert = LLM(tiny_qwen3_moe_path, dtype="float32").generate(prompts, params, use_tqdm=False)
    stacked = LLM(str(tmp_path / "stacked"), dtype="float32").generate(prompts, params, use_tqdm=False)
    for a, b in zip(per_expert, stacked):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in s.items()} for s in a.outputs[0].logprobs] == [
            {t: lp.logprob for t, lp in s.items()} for s in b.outputs[0].logprobs
        ]


def test_a_stacked_tensor_of_the_wrong_shape_is_named(tmp_path: Path, tiny_qwen3_moe_path: str) -> None:
    _stack_experts(tiny_qwen3_moe_path, tmp_path / "bad", num_experts=8)
    tensors = load_file(str(tmp_path / "bad" / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[name] = tensors[name][:7]  # one expert short
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj.*expected"):
        LLM(str(tmp_path / "bad"), dtype="float32")


def test_top_k_beyond_the_experts_is_refused(tmp_path: Path, tiny_mixtral_path: str) -> None:
    folder = tmp_path / "mixtral"
    shutil.copytree(tiny_mixtral_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 5  # of 4 experts
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        LLM(str(folder), dtype="float32")


def test_which_layers_route_to_experts() -> None:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
                num_hidden_layers=6, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=8)  # fmt: skip
    every_second = ModelArchConfig.from_hf_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [5]})
    assert every_second.moe_layers == (1, 3)
    assert not every_second.norm_topk_prob
    mixtral = ModelArchConfig.from_hf_config({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4})
    assert mixtral.moe_layers == tuple(range(6)) and mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 32
    validate_arch_config(mixtral)
    dense = ModelArchConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"]})
    assert dense.moe_layers == () and dense.num_experts == 0
