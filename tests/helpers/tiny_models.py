"""Tiny random-weight Hugging Face models for the tests: their shape, and how they are written
(with the default model's tokenizer, so text prompts go through them)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagellm.benchmarks.random_model import randomize_norms_and_biases

TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)
# Llama-3 style rope scaling with a short original context, so small positions exercise it.
TINY_LLAMA_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def write_tiny_model(folder: Path, config, tokenizer) -> str:
    """Build a random-weight model from ``config`` (fixed seed) and save it with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


def token_ids(tokenizer) -> dict[str, int | None]:
    """Vocab size and special ids shared by every tiny model."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
