"""Hugging Face greedy decoding: the reference our engine must match token for token."""

from __future__ import annotations

import contextlib

import torch


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding with HF's own KV cache; stops after a token in ``stop_ids``."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_new_tokens):
        next_token = int(out.logits[0, -1].argmax())
        tokens.append(next_token)
        if next_token in stop_ids:
            break
        out = model(torch.tensor([[next_token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def _no_init() -> contextlib.AbstractContextManager:
    """Skip HF's random init (seconds for 135M params on 2 cores); every weight is loaded after."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # other transformers versions: just pay for the init
        return contextlib.nullcontext()
    return no_init_weights()


def load_hf_gguf_reference(gguf_path: str) -> torch.nn.Module:
    """HF LlamaForCausalLM on float32 weights dequantized by transformers' own GGUF reader.

    Same code path as ``from_pretrained(gguf_file=..., GgufConfig(dequantize=True))`` for
    Llama, without the ``accelerate`` dependency that ``from_pretrained`` insists on.
    """
    from pathlib import Path

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(gguf_path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    config._attn_implementation = "eager"
    with _no_init():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF reference load mismatch: {result}")
    model.tie_weights()
    return model.eval()
