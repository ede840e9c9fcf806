"""Shared fixtures: the default model's path and tiny random-weight HF models with a real tokenizer.

The tiny models reuse the default model's tokenizer (vocab 49152, its bos/eos ids) so engine
tests can push text prompts through them, while weights stay small enough to build in seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import parallel
from tests.helpers.mla_models import write_tiny_glm4_moe
from tests.helpers.tiny_models import TINY_LLAMA_ROPE, TINY_SHAPE, edit_tensors, token_ids, write_tiny_model

# The DeepSeek family's tiny models (MLA) and their fixtures.
pytest_plugins = ("tests.helpers.mla_models", "tests.helpers.mtp_models")

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


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Llama (untied lm_head, GQA, llama3 rope scaling) as an HF safetensors folder."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **TINY_SHAPE,
        **token_ids(default_tokenizer),
        rope_parameters=dict(TINY_LLAMA_ROPE),
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen2 (q/k/v bias, tied embeddings, GQA) as an HF safetensors folder."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        **TINY_SHAPE,
        **token_ids(default_tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=0.1,
    )
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_yarn_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen2 with YaRN rope scaling from a 32-token original context (as Qwen2.5 extends
    its context), so short prompts cross the ramp and the attention factor scales cos/sin."""
    from transformers import Qwen2Config

    rope = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    config = Qwen2Config(**TINY_SHAPE, **token_ids(default_tokenizer), rope_parameters=rope, tie_word_embeddings=True,
                         use_sliding_window=False, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_yarn"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_linear_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Llama with linear rope scaling (position interpolation by 4)."""
    from transformers import LlamaConfig

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    config = LlamaConfig(**TINY_SHAPE, **token_ids(default_tokenizer), rope_parameters=rope, initializer_range=0.1)
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama_linear"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_phi3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Phi-3 (q/k/v and gate/up stored fused in the checkpoint, untied head)."""
    from transformers import Phi3Config

    config = Phi3Config(**TINY_SHAPE, **token_ids(default_tokenizer), sliding_window=None, initializer_range=0.1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_phi3_longrope_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Phi-3 with LongRoPE (as Phi-3-mini-128k and Phi-3.5-mini): its short factors and
    attention factor apply within the 64-token original context the tests stay in."""
    from transformers import Phi3Config

    half = TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"] // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.25 * i for i in range(half)],
            "long_factor": [2.0 + i for i in range(half)], "original_max_position_embeddings": 64}  # fmt: skip
    config = Phi3Config(**TINY_SHAPE, **token_ids(default_tokenizer), sliding_window=None, initializer_range=0.1,
                        rope_parameters=rope, original_max_position_embeddings=64)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_phi3_longrope"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_mistral_window_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Mistral with a sliding window of 8 positions: prompts longer than that attend to
    their last 8 only."""
    from transformers import MistralConfig

    config = MistralConfig(**TINY_SHAPE, **token_ids(default_tokenizer), sliding_window=8, initializer_range=0.1,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_mistral_window"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_window_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen3 whose layers past the first (``max_window_layers``) keep a sliding window of 8
    (transformers writes ``layer_types``): a global layer and a windowed one, with q/k norms."""
    from transformers import Qwen3Config

    config = Qwen3Config(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=32, use_sliding_window=True,
                         sliding_window=8, max_window_layers=1, tie_word_embeddings=True, initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_window"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen3 (per-head q/k RMSNorm, no q/k/v bias, head_dim 32: q is twice the hidden width)."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        **TINY_SHAPE,
        **token_ids(default_tokenizer),
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        initializer_range=0.1,
    )
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dynamic_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Llama with dynamic NTK rope over a context of 16 (served to 64): prompts pass it."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**TINY_SHAPE, "max_position_embeddings": 16}, **token_ids(default_tokenizer),
                         rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                         initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_llama_dynamic"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen3-MoE: layer 0 routes each token to 2 of 8 experts (renormalised), layer 1 is
    dense (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=32, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                            tie_word_embeddings=True, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_mixtral_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Mixtral: every layer routes each token to 2 of 4 experts (checkpoint names
    ``block_sparse_moe.experts.E.w1/w2/w3``)."""
    from transformers import MixtralConfig

    shape = {**TINY_SHAPE, "intermediate_size": 48}  # each expert's width
    config = MixtralConfig(**shape, **token_ids(default_tokenizer), num_local_experts=4, num_experts_per_tok=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Gemma 2: windowed (8 positions) and global layers alternating, capped attention
    scores and logits (caps low enough to bite on random weights), a score scale of its own."""
    from transformers import Gemma2Config

    config = Gemma2Config(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, sliding_window=8,
                          query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                          initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_gemma2"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Gemma 3 (text): a windowed layer (8 positions, local rope base) then a global one
    (linear rope scaling), q/k norms, no caps."""
    from transformers import Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}  # fmt: skip
    config = Gemma3TextConfig(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, sliding_window=8,
                              query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters=rope, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma3_multimodal_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Gemma 3 as the 4B+ checkpoints are published (Gemma3ForConditionalGeneration: the text
    model of tiny_gemma3 under ``language_model``, a SigLIP vision tower and a projector); the
    text config lists only what differs from transformers' defaults, as on the Hub."""
    import json

    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}  # fmt: skip
    text = Gemma3TextConfig(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, sliding_window=8,
                            query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                            rope_parameters=rope, initializer_range=0.1)  # fmt: skip
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)  # fmt: skip
    vocab = len(default_tokenizer)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1,
                          boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
                          eos_token_id=default_tokenizer.eos_token_id)  # fmt: skip
    path = write_tiny_model(tmp_path_factory.mktemp("tiny_gemma3_multimodal"), config, default_tokenizer)
    config_file = Path(path) / "config.json"
    saved = json.loads(config_file.read_text())
    defaults = Gemma3TextConfig().to_dict()
    saved["text_config"] = {k: v for k, v in saved["text_config"].items() if defaults.get(k) != v}
    config_file.write_text(json.dumps(saved))
    return path


@pytest.fixture
def cpu_plan():
    """``cpu_plan(dtype, **kernel_options)``: the kernel plan an engine on this CPU would run
    (the environment's kernel configuration, ``kernel_options`` on top) for ``dtype``."""
    from pagellm.config import KernelConfig
    from pagellm.worker.kernel_plan import plan_kernels

    def make(dtype: torch.dtype, **options: object):
        return plan_kernels(KernelConfig.from_env(**options), torch.device("cpu"), "auto", lambda fast: dtype)

    return make


# ---- Under pytest-xdist (make test): each worker's share of the CPUs, long modules first ----
# (tests/helpers/parallel.py, docs/testing.md)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is not loaded
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per CPU this process may use (xdist's own count can be the
    host's), at most :data:`parallel.MAX_AUTO_WORKERS`."""
    return min(parallel.usable_cpus(), parallel.MAX_AUTO_WORKERS)


def pytest_configure(config: pytest.Config) -> None:
    threads = parallel.worker_threads(config)
    if threads is not None:
        torch.set_num_threads(threads)
        # The processes the tests start (servers, ranks, pytest runs) keep their own thread
        # counts; their idle OpenMP threads sleep instead of spinning on a CPU the other
        # workers need (libgomp's default spins first). Same threads, same results.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parallel.worker_count(config):  # every worker collects, and so orders, the same way
        parallel.long_modules_first(items, config.rootpath)


@pytest.fixture(autouse=True)
def _worker_threads(request: pytest.FixtureRequest) -> None:
    """Back to the worker's share before each test: an engine built with num_threads=N sets
    torch's threads for its whole process."""
    threads = parallel.worker_threads(request.config)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_phi4_mini_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Phi-4-mini: Phi-3 with partial rotary (half of each head turned) and LongRoPE over
    the rotary dims, a short original context so that both factor sets run."""
    from transformers import Phi3Config

    half = TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"] // 4  # rotary dims / 2
    config = Phi3Config(
        **{**TINY_SHAPE, "max_position_embeddings": 256}, **token_ids(default_tokenizer),
        partial_rotary_factor=0.5, original_max_position_embeddings=32, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0 + 0.1 * i for i in range(half)],
                         "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 32},
        initializer_range=0.1,
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_phi4_mini"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_smollm3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny SmolLM3: every other layer without rotary (NoPE; the real model: every 4th), 4 layers."""
    from transformers import SmolLM3Config

    config = SmolLM3Config(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                           no_rope_layer_interval=2, tie_word_embeddings=True, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_smollm3"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_olmo2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny OLMo 2: norms after each block only, q/k norms over the whole projection."""
    from transformers import Olmo2Config

    config = Olmo2Config(**TINY_SHAPE, **token_ids(default_tokenizer), tie_word_embeddings=False, initializer_range=0.1)
    return write_tiny_model(tmp_path_factory.mktemp("tiny_olmo2"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_granite_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Granite (3.x): embedding, attention and residual multipliers, logits divided."""
    from transformers import GraniteConfig

    config = GraniteConfig(**TINY_SHAPE, **token_ids(default_tokenizer), embedding_multiplier=6.0,
                           attention_multiplier=0.2, residual_multiplier=0.3, logits_scaling=4.0,
                           tie_word_embeddings=True, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_granite"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_glm4_moe_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4.5 (Air) (``write_tiny_glm4_moe``) with a multi-token-prediction layer in the
    checkpoint that the causal LM does not load."""
    return write_tiny_glm4_moe(tmp_path_factory.mktemp("tiny_glm4_moe"), default_tokenizer)


@pytest.fixture(scope="session")
def tiny_gpt_oss_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny gpt-oss: attention sinks, windowed (8) and global layers alternating, YaRN, a router
    with a bias, experts with biases and a SwiGLU clamped low enough (0.5) to bite."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        **{**TINY_SHAPE, "intermediate_size": 32}, **token_ids(default_tokenizer), head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=0.5, tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128},
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny_gpt_oss")
    write_tiny_model(folder, config, default_tokenizer)
    _randomize_expert_biases(folder)
    return str(folder)


def _randomize_expert_biases(folder: Path) -> None:
    """transformers initializes gpt-oss's expert biases to zeros (and our randomizer sees only
    names ending in ".bias"): random ones, so a misplaced bias shows."""
    generator = torch.Generator().manual_seed(11)

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.endswith("_proj_bias")]:
            tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.2

    edit_tensors(folder, edit)


@pytest.fixture(scope="session")
def tiny_olmo3_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny OLMo 3: OLMo 2's norms, three windowed layers (window 8) then a global one, each type
    with its own rope (the global layers' YaRN-scaled)."""
    from transformers import Olmo3Config

    config = Olmo3Config(
        **{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer), sliding_window=8,
        tie_word_embeddings=False, initializer_range=0.1,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 128}},
    )  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_olmo3"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_moe_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen2-MoE: top-4 of 8 experts (not renormalised), a shared expert gated by a sigmoid,
    q/k/v bias, the second of two layers sparse."""
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(**TINY_SHAPE, **token_ids(default_tokenizer), moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=4, shared_expert_intermediate_size=48, decoder_sparse_step=2,
                            tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_moe"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_glm4_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny GLM-4 (0414): norms before and after each block, gate and up fused, q/k/v bias, and a
    rotary over interleaved pairs of half of each head's dims."""
    from transformers import Glm4Config

    config = Glm4Config(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, attention_bias=True,
                        tie_word_embeddings=False, initializer_range=0.1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_glm4"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_exaone4_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny EXAONE 4 (hybrid): three windowed layers (window 8) then a global one without rope,
    norms after each block only, per-head q/k norms."""
    from transformers import Exaone4Config

    config = Exaone4Config(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer), sliding_window=8,
                           sliding_window_pattern=4, tie_word_embeddings=False, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_exaone4"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_seed_oss_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Seed-OSS: q/k/v bias, an o_proj bias of its own switch, an MLP bias."""
    from transformers import SeedOssConfig

    config = SeedOssConfig(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, attention_bias=True,
                           attention_out_bias=True, mlp_bias=True, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_seed_oss"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_ernie4_5_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny ERNIE 4.5 (dense): biases on every linear, a rotary over interleaved pairs."""
    from transformers import Ernie4_5Config

    config = Ernie4_5Config(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, use_bias=True,
                            initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_ernie4_5"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_hunyuan_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Hunyuan (dense v1): per-head q/k norms after the rotary, a rope base stretched by a
    fixed NTK alpha (its checkpoints' "dynamic" rope)."""
    from transformers import HunYuanDenseV1Config

    config = HunYuanDenseV1Config(**TINY_SHAPE, **token_ids(default_tokenizer), head_dim=16, tie_word_embeddings=False,
                                  initializer_range=0.1,
                                  rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0,
                                                   "factor": 1.0})  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_hunyuan"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_granite_hybrid_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Granite-4.0-H (dense): Mamba-2 layers around one attention layer without rope, two
    groups of B and C, a chunk of 8 tokens (a prompt's scan crosses chunks), Granite's multipliers."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                                    layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                                    shared_intermediate_size=96, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                                    mamba_d_conv=4, mamba_chunk_size=8, embedding_multiplier=0.5,
                                    attention_multiplier=0.2, residual_multiplier=1.5, logits_scaling=4.0,
                                    initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_granite_hybrid"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_bamba_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Bamba: Mamba-2 layers (two groups of B and C, chunks of 8 tokens) around one attention
    layer with a rotary over half of each head, a dense MLP."""
    from transformers import BambaConfig

    config = BambaConfig(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                         attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                         mamba_d_conv=4, mamba_chunk_size=8, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_bamba"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_granite_hybrid_moe_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Granite-4.0-H with routed experts (H Tiny's layout): top-2 of 4 experts (their float32
    logits softmaxed) beside the shared MLP in every layer, rope in the attention layer."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(**{**TINY_SHAPE, "num_hidden_layers": 3, "intermediate_size": 32},
                                    **token_ids(default_tokenizer), layer_types=["mamba", "attention", "mamba"],
                                    num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                                    position_embedding_type="rope", mamba_n_heads=4, mamba_d_state=16,
                                    mamba_chunk_size=8, embedding_multiplier=0.5, residual_multiplier=1.5,
                                    logits_scaling=2.0, initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_granite_hybrid_moe"), config, default_tokenizer)


# Tiny Qwen3.5 layers (dense and MoE): gated delta-nets of two key heads, two value heads each,
# a rotary over half of each attention head.
_TINY_QWEN3_5 = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4, initializer_range=0.1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
_DELTA, _FULL = "linear_attention", "full_attention"


@pytest.fixture(scope="session")
def tiny_qwen3_5_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen3.5 (text): gated delta-net layers around one attention layer whose output is gated,
    norms by (1 + weight)."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                               layer_types=[_DELTA, _DELTA, _FULL, _DELTA], **_TINY_QWEN3_5)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny Qwen3.5 MoE: Qwen3.5's layers with every MLP top-2 of 4 experts (renormalised) beside a
    shared expert gated by a sigmoid."""
    from transformers import Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                                  layer_types=[_DELTA, _FULL, _DELTA, _DELTA], num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                  **_TINY_QWEN3_5)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_5_moe"), config, default_tokenizer)


@pytest.fixture(scope="session")
def tiny_lfm2_path(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> str:
    """Tiny LFM2 (hybrid): short-convolution layers around one attention layer (per-head q/k
    norms), so a short prompt carries each convolution's state across chunks and steps."""
    from transformers import Lfm2Config

    config = Lfm2Config(**{**TINY_SHAPE, "num_hidden_layers": 4}, **token_ids(default_tokenizer),
                        norm_eps=1e-5, layer_types=["conv", "conv", "full_attention", "conv"], initializer_range=0.1)  # fmt: skip
    return write_tiny_model(tmp_path_factory.mktemp("tiny_lfm2"), config, default_tokenizer)
