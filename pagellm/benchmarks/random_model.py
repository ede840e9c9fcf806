"""Random-weight models of a given shape, as Hugging Face folders, for machines without real weights.

Throughput depends on a model's shapes, not on its weight values: a random model of
SmolLM2-135M's shape runs the same matmuls and moves the same KV cache bytes (with
``ignore_eos`` every request runs to its ``max_tokens``). The folder holds ``config.json``,
safetensors weights and a synthetic word-level tokenizer with one word per id of the
vocabulary (``w123`` is id 123), so every generated id decodes; nothing is downloaded and
the default model package is not needed (e.g. on a GPU machine with no network).

    python -m pagellm.benchmarks.random_model OUT_DIR [--shape smollm2-135m] [--dtype bfloat16]
    python -m pagellm.benchmarks throughput --model OUT_DIR --device cuda --compare hf

The shapes people run (:data:`REAL_SHAPES`: Llama 3.2 1B and 3B, Llama 3 8B, Qwen2.5 7B) are
written tensor by tensor with the default model's tokenizer (``benchmarks.random_gguf``), as
safetensors or, with ``--gguf Q4_0|Q4_K_M|Q8_0|BF16``, as one GGUF file in llama-quantize's mix:

    python -m pagellm.benchmarks.random_model /tmp/llama-3b-q4_0.gguf --shape llama-3b --gguf Q4_0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from pagellm.benchmarks.random_gguf import FILE_TYPES, write_random_gguf, write_random_safetensors
from pagellm.benchmarks.random_mtp import add_random_mtp_layer
from pagellm.benchmarks.random_norms import randomize_norms_and_biases

# Special tokens take the first ids, as in SmolLM2's vocabulary.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        architecture="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's layers with 8 heads of 64 (4 KV heads): its 9 heads split only by 3; these
    # split by 2 and 4 (tensor-parallel measurements, NOTES 46).
    "smollm2-135m-8heads": dict(
        architecture="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M's layers with a mixture of 8 experts of 768, top 2: the same MLP work per token
    # as its dense 1536 (NOTES 48 compares the two).
    "smollm2-135m-moe": dict(
        architecture="mixtral", hidden_size=576, intermediate_size=768, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True, num_local_experts=8, num_experts_per_tok=2,
    ),
    # SmolLM2-135M's layers as SmolLM3 builds them: every 4th layer without rotary (NoPE).
    "smollm3-135m": dict(
        architecture="smollm3", hidden_size=576, intermediate_size=1536, num_hidden_layers=32,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True, no_rope_layer_interval=4,
    ),
    # Qwen3-0.6B's shape (per-head q/k norms, head_dim 128 wider than hidden / heads, tied embeddings).
    "qwen3-0.6b": dict(
        architecture="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # A Qwen3.5-0.8B-sized hybrid (hidden 1024, 24 layers: gated delta-nets of 16 key and 16 value
    # heads of 128, attention every 4th layer with 8 heads of 256 (2 KV) gated and a quarter rotary),
    # with the default model's vocabulary: the scan layers' speed at a real size (NOTES 72).
    "qwen3.5-0.8b": dict(
        architecture="qwen3_5", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=49152, max_position_embeddings=8192,
        rms_norm_eps=1e-6, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    # A Mamba-2 hybrid of about 1B parameters with Granite-4.0-H's layer kinds (a shape chosen here,
    # not a released model's: 36 Mamba-2 layers of 48 heads x 64 and a 128-wide state in one group,
    # 4 attention layers without rope, a dense MLP), the default model's vocabulary: NOTES 73.
    "mamba2-hybrid-1b": dict(
        architecture="granitemoehybrid", hidden_size=1536, intermediate_size=4096, shared_intermediate_size=4096,
        num_hidden_layers=40, num_attention_heads=12, num_key_value_heads=4, vocab_size=49152,
        max_position_embeddings=8192, rms_norm_eps=1e-5, num_local_experts=0, mamba_n_heads=48, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, tie_word_embeddings=True,
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)],
    ),
    # Multi-head latent attention at a real width (NOTES 77): Moonlight-16B-A3B's (and DeepSeek-V2-Lite's)
    # attention (hidden 2048, 16 heads, a 512-value latent and a 64-dim rotary part cached, no query
    # bottleneck) with Llama 3.2 1B's dense MLP and depth in place of its experts, the default vocabulary.
    "mla-1b": dict(
        architecture="deepseek_v3", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
    # The shapes people run (REAL_SHAPES): Llama 3.2 1B and 3B (tied), Llama 3 8B, Qwen2.5 7B.
    # Rotary scaling left at the default: it changes no cost.
    "llama-1b": dict(
        architecture="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "llama-3b": dict(
        architecture="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "llama-8b": dict(
        architecture="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "qwen-7b": dict(
        architecture="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # The tests' tiny shapes: GQA, untied Llama with llama3 rope scaling, tied Qwen2 with q/k/v bias.
    "tiny-llama": dict(
        architecture="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    # One tiny folder per further family (pagellm serve PATH on each; docs/models.md).
    "tiny-qwen3": dict(
        architecture="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-phi3-longrope": dict(
        architecture="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None, initializer_range=0.1,
        original_max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                         "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
    ),
    "tiny-qwen3-moe": dict(
        architecture="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
        max_position_embeddings=512, rms_norm_eps=1e-6, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=True, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "tiny-mixtral": dict(
        architecture="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-5, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "tiny-gemma2": dict(
        architecture="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        initializer_range=0.1,
    ),
    "tiny-gemma3": dict(
        architecture="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=8, query_pre_attn_scalar=16, initializer_range=0.1,
    ),
    "tiny-qwen2": dict(
        architecture="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, use_sliding_window=False, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}


def synthetic_tokenizer(vocab_size: int):
    """A fast word-level tokenizer over ``vocab_size`` ids: special tokens, then ``w<id>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"w{i}", i) for i in range(len(SPECIAL_TOKENS), vocab_size))
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[BOS_TOKEN_ID],
        eos_token=SPECIAL_TOKENS[EOS_TOKEN_ID],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
    )


REAL_SHAPES = ("llama-1b", "llama-3b", "llama-8b", "qwen-7b")


def hf_config(shape: dict[str, Any]):
    from transformers import (
        DeepseekV3Config, Gemma2Config, Gemma3TextConfig, GraniteMoeHybridConfig, LlamaConfig, MixtralConfig, Phi3Config, Qwen2Config,
        Qwen3Config, Qwen3MoeConfig, Qwen3_5TextConfig, SmolLM3Config,
    )

    options = dict(shape)
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "phi3": Phi3Config,
               "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "gemma2": Gemma2Config,
               "gemma3_text": Gemma3TextConfig, "smollm3": SmolLM3Config, "qwen3_5": Qwen3_5TextConfig,
               "granitemoehybrid": GraniteMoeHybridConfig, "deepseek_v3": DeepseekV3Config}  # fmt: skip
    config_class = classes[options.pop("architecture")]
    return config_class(**options, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=0)


def write_random_model(
    folder: str | Path, shape: str | dict[str, Any] = "smollm2-135m", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> str:
    """Write a random-weight model of ``shape`` (a name in ``SHAPES`` or such a dict) to ``folder``.

    Norm weights and biases are randomized too (:func:`randomize_norms_and_biases`). The
    :data:`REAL_SHAPES` are written by ``random_gguf`` (its weights, the default tokenizer).
    Returns the folder as a string.
    """
    from transformers import AutoModelForCausalLM

    spec = SHAPES[shape] if isinstance(shape, str) else shape
    config = hf_config(spec)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if shape in REAL_SHAPES:  # tensor by tensor: an 8B model does not fit in memory as float32
        config.dtype = dtype
        config.save_pretrained(folder)
        return write_random_safetensors(folder, spec, dtype, seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    synthetic_tokenizer(config.vocab_size).save_pretrained(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagellm.benchmarks.random_model", description=__doc__.split("\n")[0])
    parser.add_argument("folder", help="where to write the model (created; with --gguf: the .gguf file)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="checkpoint dtype")
    parser.add_argument("--gguf", choices=sorted(FILE_TYPES), default=None,
                        help=f"write one GGUF file in llama-quantize's mix of this type ({', '.join(REAL_SHAPES)})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp", action="store_true",
                        help="with a random multi-token-prediction layer (speculative method mtp; mla-1b, qwen3.5-0.8b)")
    args = parser.parse_args(argv)
    if args.mtp and (args.gguf or SHAPES[args.shape]["architecture"] not in ("deepseek_v3", "qwen3_5")):
        parser.error("--mtp gives a DeepSeek-V3 or Qwen3.5 shape's safetensors folder (mla-1b, qwen3.5-0.8b) its MTP layer")
    if args.gguf:
        if args.shape not in REAL_SHAPES:
            parser.error(f"--gguf writes the shapes {list(REAL_SHAPES)}")
        counts = write_random_gguf(args.folder, SHAPES[args.shape], args.gguf, args.seed, name=args.shape)
        print(f"wrote a random {args.shape} {args.gguf} GGUF to {args.folder}: tensors per type {counts}")
        return 0
    path = write_random_model(args.folder, args.shape, getattr(torch, args.dtype), args.seed)
    if args.mtp:
        add_random_mtp_layer(path, args.seed)
    print(f"wrote a random {args.shape} model{' with an MTP layer' if args.mtp else ''} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
