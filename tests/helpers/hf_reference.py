"""Hugging Face greedy decoding: the reference our engine must match token for token."""

from __future__ import annotations

import inspect

import torch


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding with HF's own KV cache; stops after a token in ``stop_ids``.

    Runs where the model's weights are (CPU or GPU)."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt_ids], device=device), use_cache=True)
    # (transformers 5's newer models, as Bamba, name their cache ``cache``)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        next_token = int(out.logits[0, -1].argmax())
        tokens.append(next_token)
        if next_token in stop_ids:
            break
        # (its position too: transformers 5's newer models, as Bamba, count from 0 without it)
        position = torch.tensor([[len(prompt_ids) + len(tokens) - 1]], device=device)
        out = model(torch.tensor([[next_token]], device=device), position_ids=position, use_cache=True,
                    **{name: out[name]})  # fmt: skip
    return tokens


@torch.inference_mode()
def hf_beam_search(model, prompt_ids, width, max_tokens, length_penalty, eos_id):
    """Hugging Face's beam search (``generate(num_beams=...)``): the best beam's new tokens."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=width,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=True,
        max_new_tokens=max_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    generated = out[0, len(prompt_ids):].tolist()
    if eos_id in generated:  # HF pads after EOS with the pad (= eos) id
        generated = generated[: generated.index(eos_id) + 1]
    return generated


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


# Building the HF model from a GGUF file lives with the benchmarks (they need it too).
from pagellm.benchmarks.hf_baseline import _no_init  # noqa: E402,F401
from pagellm.benchmarks.hf_baseline import load_hf_gguf_model as load_hf_gguf_reference  # noqa: E402,F401
