"""Our paged, flat-batch model must produce Hugging Face's logits on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.reference import ReferenceAttention
from pagellm.model import load_model
from pagellm.model.llama import LlamaForCausalLM
from tests.helpers.paged_runner import PagedRunner

TINY_MODELS = ["tiny_llama_path", "tiny_qwen2_path", "tiny_qwen3_path", "tiny_qwen2_yarn_path", "tiny_llama_linear_path",
               "tiny_phi3_path", "tiny_phi3_longrope_path", "tiny_mistral_window_path", "tiny_qwen3_moe_path",
               "tiny_mixtral_path", "tiny_gemma2_path", "tiny_gemma3_path"]


def _prompts(vocab_size: int) -> tuple[list[int], list[int]]:
    """Two prompts of different lengths (7 and 11 tokens), fixed seed."""
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(3, vocab_size, (18,), generator=generator).tolist()
    return ids[:7], ids[7:]


def _hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@torch.inference_mode()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF logits for every position of one unpadded sequence: [len, vocab] float32."""
    return hf(torch.tensor([ids])).logits[0].float()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_mixed_prefill_and_decode_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    """Two requests in one flat batch: full prefill + prefill chunk, then decode + chunk rest, then decode."""
    path = request.getfixturevalue(fixture)
    model, arch = load_model(path, torch.float32, ReferenceAttention())
    hf = _hf_model(path)
    a, b = _prompts(arch.vocab_size)
    runner = PagedRunner(model, arch)

    # Step 1: A prefills fully, B prefills its first 5 tokens (chunked prefill).
    out_a, out_b = runner.step([(0, a), (1, b[:5])])
    _close(out_a, _hf_logits(hf, a))
    _close(out_b, _hf_logits(hf, b[:5]))

    # Step 2: A decodes one token while B prefills the rest of its prompt.
    a.append(int(out_a[-1].argmax()))
    out_a, out_b = runner.step([(0, a[-1:]), (1, b[5:])])
    _close(out_a[-1], _hf_logits(hf, a)[-1])
    _close(out_b, _hf_logits(hf, b)[5:])

    # Step 3: both decode.
    a.append(int(out_a[-1].argmax()))
    b.append(int(out_b[-1].argmax()))
    out_a, out_b = runner.step([(0, a[-1:]), (1, b[-1:])])
    _close(out_a[-1], _hf_logits(hf, a)[-1])
    _close(out_b[-1], _hf_logits(hf, b)[-1])


def test_bfloat16_loads_and_tracks_float32(tiny_llama_path: str) -> None:
    """bf16 weights and KV cache run end to end; logits stay float32 and near the fp32 ones."""
    model16, arch = load_model(tiny_llama_path, torch.bfloat16, ReferenceAttention())
    model32, _ = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    assert {p.dtype for p in model16.parameters()} == {torch.bfloat16}
    a, b = _prompts(arch.vocab_size)
    out16 = PagedRunner(model16, arch).step([(0, a), (1, b)])
    out32 = PagedRunner(model32, arch).step([(0, a), (1, b)])
    for lo, hi in zip(out16, out32):
        assert lo.dtype == torch.float32
        assert torch.isfinite(lo).all()
        assert (lo - hi).abs().max() < 0.05 * hi.abs().max()  # bf16 rounding: ~1.5% observed
        assert (lo.argmax(-1) == hi.argmax(-1)).float().mean() >= 0.9


def test_layers_run_fused_projections(tiny_llama_path: str) -> None:
    """Each layer has exactly four linears (qkv, o, gate_up, down) with the fused output widths."""
    model, arch = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4
    assert layer.self_attn.qkv_proj.weight.shape == (arch.q_size + 2 * arch.kv_size, arch.hidden_size)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * arch.intermediate_size, arch.hidden_size)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_tied_embeddings_share_storage(tiny_qwen2_path: str, tiny_llama_path: str) -> None:
    """Tied checkpoints reuse the embedding matrix as lm_head; untied ones keep their own."""
    tied, _ = load_model(tiny_qwen2_path, torch.float32, ReferenceAttention())
    untied, _ = load_model(tiny_llama_path, torch.float32, ReferenceAttention())
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_direct_construction_has_random_weights(tiny_llama_path: str) -> None:
    """Building the class directly (not via the loader) gives a usable model with the given backend."""
    from pagellm.model import load_arch_config

    arch = load_arch_config(tiny_llama_path)
    model = LlamaForCausalLM(arch, ReferenceAttention()).eval()
    a, _ = _prompts(arch.vocab_size)
    (logits,) = PagedRunner(model, arch).step([(0, a)])
    assert logits.shape == (len(a), arch.vocab_size)
    assert torch.isfinite(logits).all()
