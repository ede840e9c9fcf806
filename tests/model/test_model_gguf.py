"""The default GGUF model: our loader must equal Hugging Face's GGUF loader on dequantized weights.

Reference: transformers' own GGUF reader, see ``tests.helpers.hf_reference.load_hf_gguf_reference``.
"""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.reference import ReferenceAttention
from pagellm.model import load_arch_config, load_model
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.llama import LlamaForCausalLM
from tests.helpers.hf_reference import load_hf_gguf_reference
from tests.helpers.paged_runner import PagedRunner

pytestmark = pytest.mark.slow

GREEDY_STEPS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def ours(default_model_path_fixture: str) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    return load_model(default_model_path_fixture, torch.float32, ReferenceAttention())


@pytest.fixture(scope="module")
def hf_reference(default_model_path_fixture: str) -> torch.nn.Module:
    return load_hf_gguf_reference(default_model_path_fixture)


def test_default_arch_config(default_model_path_fixture: str) -> None:
    arch = load_arch_config(None)
    assert (arch.architecture, arch.vocab_size, arch.hidden_size) == ("LlamaForCausalLM", 49152, 576)
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, [2])


def test_weights_equal_hf_dequantized(ours: tuple[LlamaForCausalLM, ModelArchConfig], hf_reference) -> None:
    """Bit-equal weights, q/k included (catches a missing or wrong un-permutation)."""
    model, arch = ours
    reference = hf_reference.state_dict()
    for i in (0, arch.num_hidden_layers - 1):
        q, k, v = model.model.layers[i].self_attn.qkv_proj.weight.split([arch.q_size, arch.kv_size, arch.kv_size])
        prefix = f"model.layers.{i}."
        assert torch.equal(q, reference[prefix + "self_attn.q_proj.weight"])
        assert torch.equal(k, reference[prefix + "self_attn.k_proj.weight"])
        assert torch.equal(v, reference[prefix + "self_attn.v_proj.weight"])
        gate, up = model.model.layers[i].mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, reference[prefix + "mlp.gate_proj.weight"])
        assert torch.equal(up, reference[prefix + "mlp.up_proj.weight"])
    assert torch.equal(model.model.embed_tokens.weight, reference["model.embed_tokens.weight"])


def test_greedy_matches_hf(ours, hf_reference, default_tokenizer) -> None:
    """Two prompts batched together through prefill and 16 decode steps; HF checks every step.

    The reference runs once per prompt on prompt + our 16 tokens (teacher forcing): our tokens
    are HF's greedy tokens iff each equals HF's argmax on its own prefix, and the logits at
    each of those positions must match ours.
    """
    model, arch = ours
    prompts = [default_tokenizer.encode(text) for text in PROMPTS]
    runner = PagedRunner(model, arch, num_blocks=32, block_size=16)
    outs = runner.step(list(enumerate(prompts)))
    prefill_logits = outs
    step_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(GREEDY_STEPS):
        for r, out in enumerate(outs):
            step_logits[r].append(out[-1])
            tokens[r].append(int(out[-1].argmax()))
        outs = runner.step([(r, toks[-1:]) for r, toks in enumerate(tokens)])

    for r, prompt in enumerate(prompts):
        with torch.inference_mode():
            reference = hf_reference(torch.tensor([prompt + tokens[r][:-1]])).logits[0].float()
        n = len(prompt)
        torch.testing.assert_close(prefill_logits[r][:-1], reference[: n - 1], atol=2e-3, rtol=1e-3)
        assert tokens[r] == reference[n - 1 :].argmax(-1).tolist(), default_tokenizer.decode(tokens[r])
        torch.testing.assert_close(torch.stack(step_logits[r]), reference[n - 1 :], atol=2e-3, rtol=1e-3)
