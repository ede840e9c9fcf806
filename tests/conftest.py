"""Shared fixtures: the default model's path and tiny random-weight HF models with a real tokenizer.

The tiny models reuse the default model's tokenizer (vocab 49152, its bos/eos ids) so engine
tests can push text prompts through them, while weights stay small enough to build in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.fixture(scope="session")
def default_model_path_fixture() -> str:
    """Path of the default model's GGUF file."""
    from pagellm.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path_fixture: str):
    """The default model's tokenizer, built once per session (rebuilding from GGUF takes seconds)."""
    from pagellm.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path_fixture)


def _write_tiny_model(folder: Path, config, tokenizer) -> str:
    """Build a random-weight model from ``config`` (fixed seed) and save it with the tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _token_ids(tokenizer) -> dict[str, int | None]:
    """Vocab size and special ids shared by every tiny model."""
    return dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Llama (untied lm_head, GQA, llama3 rope scaling) as an HF safetensors folder."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **TINY_SHAPE,
        **_token_ids(default_tokenizer),
        rope_parameters=dict(TINY_LLAMA_ROPE),
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen2 (q/k/v bias, tied embeddings, GQA) as an HF safetensors folder."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        **TINY_SHAPE,
        **_token_ids(default_tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=0.1,
    )
    return _write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), config, default_tokenizer)


@pytest.fixture
def cpu_plan():
    """``cpu_plan(dtype, **kernel_options)``: the kernel plan an engine on this CPU would run
    (the environment's kernel configuration, ``kernel_options`` on top) for ``dtype``."""
    from pagellm.config import KernelConfig
    from pagellm.worker.kernel_plan import plan_kernels

    def make(dtype: torch.dtype, **options: object):
        return plan_kernels(KernelConfig.from_env(**options), torch.device("cpu"), "auto", lambda fast: dtype)

    return make
