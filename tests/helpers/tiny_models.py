"""Tiny random-weight Hugging Face models for the tests: their shape, and how they are written
(with the default model's tokenizer, so text prompts go through them)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagellm.benchmarks.random_norms import randomize_norms_and_biases

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


def edit_tensors(folder: Path, edit) -> None:
    """Change a tiny model's one safetensors shard in place (``edit`` takes its name -> tensor dict)."""
    from safetensors.torch import load_file, save_file

    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def token_ids(tokenizer) -> dict[str, int | None]:
    """Vocab size and special ids shared by every tiny model."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def write_scripted_model(folder: Path, tokenizer, reply: str, max_position_embeddings: int = 65536) -> str:
    """A tiny Llama that answers any chat prompt with ``reply`` and then its end-of-sequence token,
    greedily (for clients that read an answer: agent CLIs in the tests). Its layers add nothing
    (zero output projections), so each position's logits read only its own token's embedding:
    ``lm_head`` maps the prompt's last token (the newline after the template's assistant header)
    to the reply's first token, each reply token to the next, and every other token to EOS
    (through one embedding component all tokens share)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": max_position_embeddings}, **token_ids(tokenizer),
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.normal_()
        embed[:, 0] = 1.0  # the component every token shares: EOS unless the script says otherwise
        head = model.lm_head.weight
        head.zero_()
        head[tokenizer.eos_token_id, 0] = 4.0
        chain = tokenizer("\n", add_special_tokens=False).input_ids[-1:] + tokenizer(reply, add_special_tokens=False).input_ids
        for token, following in zip(chain, [*chain[1:], tokenizer.eos_token_id]):
            head[following] += 10.0 * embed[token] / embed[token].pow(2).mean().sqrt()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)
