"""Every engine option, declared once.

``EngineArgs`` is the one place an option is named, typed, defaulted and documented. Everything
else is derived from it: the ``LLM`` keywords (``LLM(model, **options)`` builds an
``EngineArgs``), the engine flags of ``pagellm serve`` / ``generate`` and of the benchmarks
(:func:`add_engine_args`), and the validated :class:`~pagellm.config.EngineConfig` the engine
runs on (:meth:`EngineArgs.create_engine_config`, where every value is checked).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch

from pagellm.config import (
    CPU_BIND_CHOICES,
    EXECUTOR_BACKENDS,
    GEMM_CHOICES,
    ISA_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KernelConfig,
    LimitsConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagellm.lora_config import LoRAConfig
from pagellm.model.default_model import DEFAULT_MODEL_NAME
from pagellm.pooler_config import PoolerConfig
from pagellm.speculative_config import SpeculativeConfig

# CLI argument groups, in the order the help shows them.
ENGINE, KERNELS, LIMITS = "engine", "CPU kernels (the kernel plan; the start-up log and /version show it)", "request limits"


def _option(help: str, group: str = ENGINE, kind: type | None = None, choices: tuple[str, ...] | None = None,
            flag: bool = False) -> dict[str, Any]:
    """A field's CLI description: ``kind`` parses the value (None: a string), ``flag`` makes a
    ``--x / --no-x`` switch."""
    return {"help": help, "group": group, "kind": kind, "choices": choices, "flag": flag}


@dataclass
class EngineArgs:
    """The engine's options (see the module docstring). Values are checked by
    :meth:`create_engine_config`; None for the CPU-kernel options means "the environment's"
    (``KernelConfig.from_env``)."""

    model: str | None = field(default=None, metadata=_option(
        f"HF folder (config.json + safetensors) or .gguf file; default: {DEFAULT_MODEL_NAME}"))
    dtype: str | torch.dtype = field(default="auto", metadata=_option(
        "auto (bfloat16 for 16-bit/GGUF checkpoints where the kernel plan multiplies bf16 fast, else float32), "
        "float32 or bfloat16"))
    quantization: str = field(default="auto", metadata=_option(
        "auto (a quantized GGUF's weights on integer kernels: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K as they are, other types "
        "re-quantized to int8 blocks; unless the dtype is float32), none (dequantized), gguf (as auto, required), "
        "int8 (any checkpoint's linears to int8 blocks)", choices=QUANTIZATION_CHOICES))
    block_size: int = field(default=16, metadata=_option("tokens per KV-cache block", kind=int))
    kv_cache_memory: int | str = field(default="auto", metadata=_option(
        "KV-cache budget, e.g. 512MiB or 2GiB; auto: what memory is left once the weights are in (90%, less a step's "
        "activations, shared by the ranks and replicas on this host)"))
    num_kv_blocks: int | None = field(default=None, metadata=_option(
        "exact number of KV blocks (overrides the memory budget)", kind=int))
    enable_prefix_caching: bool = field(default=True, metadata=_option(
        "reuse the KV blocks of prompt prefixes already computed (default: on)", flag=True))
    kv_cache_dtype: str = field(default="auto", metadata=_option(
        "K/V storage: auto (the model's dtype), fp8 (= fp8_e4m3: half the memory of bf16, rounded) or int8 "
        "(per-token-per-head scales: about half of bf16's memory, plus 4 bytes a head)",
        choices=KV_CACHE_DTYPE_CHOICES))
    packed_weights_cache_size: int | str = field(default="16GiB", metadata=_option(
        "GGUF models of 256 MiB and more: the most their packed weights, kept on disk so that later starts map them "
        "instead of packing again, take in $PAGELLM_CACHE_DIR/packed-weights (least recently used dropped; "
        "0: not kept)"))
    kv_offload_dir: str | None = field(default=None, metadata=_option(
        "a folder for a disk tier under the prefix cache: full KV blocks written once, read back on a prefix hit "
        "the pool no longer holds, kept across restarts (docs/disk-tier.md); default: none"))
    kv_offload_size: int | str = field(default="16GiB", metadata=_option(
        "--kv-offload-dir: the most its entries take, e.g. 64GiB (least recently used dropped)"))
    state_snapshot_interval: int | None = field(default=None, metadata=_option(
        "models with scan layers (Mamba-2, gated delta-net): the prefix cache keeps their states every this many "
        "prompt tokens (a multiple of --block-size; default: the first from 512) and at each prompt's last full block",
        kind=int))
    max_state_snapshots: int | None = field(default=None, metadata=_option(
        "models with scan layers: the most state snapshots kept for the prefix cache, least recently used dropped "
        "(default: max(4, max_num_seqs / 4); 0: no prefix cache)", kind=int))
    speculative_config: str | dict[str, Any] | None = field(default=None, metadata=_option(
        'speculative decoding, a JSON object with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4}\' (docs/speculative-decoding.md); default: none'))
    pooler_config: str | dict[str, Any] | None = field(default=None, metadata=_option(
        'how /v1/embeddings and LLM.embed pool hidden states, a JSON object with vLLM\'s keys, e.g. \'{"pooling_type": '
        '"MEAN", "normalize": true}\' (docs/embeddings.md); default: the model\'s sentence-transformers files, else '
        'the last token, normalized'))
    enable_lora: bool = field(default=False, metadata=_option(
        "serve LoRA adapters over the model, mixed in one batch (docs/lora.md)", flag=True))
    max_loras: int = field(default=1, metadata=_option(
        "--enable-lora: most adapters one step mixes (each resident in its own weight buffers)", kind=int))
    max_lora_rank: int = field(default=16, metadata=_option("--enable-lora: the largest adapter rank served", kind=int))
    max_cpu_loras: int | None = field(default=None, metadata=_option(
        "--enable-lora: adapters kept loaded in host memory, least recently used evicted (default: --max-loras)",
        kind=int))
    max_num_seqs: int = field(default=128, metadata=_option("most sequences in one step", kind=int))
    max_num_batched_tokens: int = field(default=2048, metadata=_option("most tokens computed in one step", kind=int))
    scheduling_policy: str = field(default="fcfs", metadata=_option(
        "fcfs (first come, first served) or priority (each request's priority, lower first, then arrival; a "
        "waiting request preempts a running one of a worse priority)", choices=SCHEDULING_POLICIES))
    priority_aging_steps: int = field(default=1000, metadata=_option(
        "priority policy: a waiting request's priority improves one level every this many steps (bounds "
        "starvation)", kind=int))
    max_model_len: int | None = field(default=None, metadata=_option("context limit (default: the model's)", kind=int))
    seed: int = field(default=0, metadata=_option("seed for sampling without a per-request seed", kind=int))
    device: str = field(default="cpu", metadata=_option("cpu (or cuda / mps where available)"))
    attention_backend: str = field(default="auto", metadata=_option(
        "auto (cpu_paged on CPU where its C++ kernels build, else torch_sdpa), cpu_paged, torch_sdpa or reference"))
    chat_template: str | None = field(default=None, metadata=_option(
        "Jinja file that replaces the model's chat template, or chatml-tools (shipped: ChatML with tools)"))
    num_threads: int | None = field(default=None, metadata=_option(
        "torch threads (default: torch's choice), split evenly among the ranks (tensor and pipeline)", kind=int))
    tensor_parallel_size: int = field(default=1, metadata=_option(
        "processes that each hold a share of every layer (attention heads, MLP width), joined by an "
        "all-reduce per layer half (CPU: shared memory, or gloo)", kind=int))
    pipeline_parallel_size: int = field(default=1, metadata=_option(
        "stages (processes, or groups of tensor-parallel ranks) that each hold consecutive layers, "
        "passing hidden states on; each step runs as micro-batches so the stages overlap", kind=int))
    nnodes: int = field(default=1, metadata=_option(
        "nodes (hosts) the engine's ranks spread over, evenly; each runs the same command with its --node-rank", kind=int))
    node_rank: int = field(default=0, metadata=_option(
        "this node's index: 0 serves the API; the others run their ranks headless", kind=int))
    master_addr: str = field(default="127.0.0.1", metadata=_option("node 0's address, where every rank meets"))
    master_port: int | None = field(default=None, metadata=_option(
        "the TCP port on node 0 where every rank meets (required with --nnodes > 1)", kind=int))
    distributed_executor_backend: str = field(default="mp", metadata=_option(
        "how the ranks run: mp (processes of this host, and of the other --nnodes) or ray (actors "
        "on a Ray cluster: pip install 'pagellm[ray]')", choices=EXECUTOR_BACKENDS))
    cpu_bind: str = field(default="auto", metadata=_option(
        "auto: bind each rank's threads (tensor and pipeline parallelism) to its own CPUs (one NUMA node per rank where "
        "there are enough, else an even split); none: leave them to the OS", choices=CPU_BIND_CHOICES))
    max_n: int = field(default=128, metadata=_option(
        "most samples (n, best_of) or beams one request may ask for; never above --max-num-seqs", LIMITS, int))
    max_logprobs: int = field(default=20, metadata=_option(
        "most top logprobs per position a request may ask for", LIMITS, int))
    max_stop_strings: int = field(default=16, metadata=_option("most stop strings in one request", LIMITS, int))
    grammar_compile_timeout: float = field(default=10.0, metadata=_option(
        "seconds a structured-outputs constraint may take to compile before its request fails", LIMITS, float))
    max_grammar_chars: int = field(default=128 * 1024, metadata=_option(
        "most characters of one structured-outputs constraint (JSON schema, regex, grammar, choices)", LIMITS, int))
    limit_mm_per_prompt: str | dict[str, int] | None = field(default=None, metadata=_option(
        'most items of each modality in one prompt, as JSON (vLLM\'s): {"image": 8} (the default; 0 takes none)',
        LIMITS))
    max_image_pixels: int = field(default=4096 * 4096, metadata=_option(
        "most pixels (width x height) of one image in a prompt", LIMITS, int))
    cpu_isa: str | None = field(default=None, metadata=_option(
        "highest ISA level the kernels may use (default: $PAGELLM_ISA, else auto: the CPU's)", KERNELS,
        choices=ISA_CHOICES))
    cpu_kernels: bool | None = field(default=None, metadata=_option(
        "use pagellm's C++ CPU kernels (default: yes, unless $PAGELLM_CPU_KERNELS=0)", KERNELS, flag=True))
    gemm: str | None = field(default=None, metadata=_option(
        "GEMM of linear layers (16-bit; float32 on AVX2): auto, pagellm, onednn or torch", KERNELS,
        choices=GEMM_CHOICES))

    def create_engine_config(self) -> EngineConfig:
        """The validated configuration (each part checks its own values)."""
        return EngineConfig(
            model=ModelConfig(
                model=self.model, dtype=self.dtype, max_model_len=self.max_model_len, seed=self.seed,
                chat_template=self.chat_template, quantization=self.quantization,
                packed_weights_cache_size=self.packed_weights_cache_size,
            ),
            cache=CacheConfig(
                block_size=self.block_size, kv_cache_memory=self.kv_cache_memory, num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching, kv_cache_dtype=self.kv_cache_dtype,
                kv_offload_dir=self.kv_offload_dir, kv_offload_size=self.kv_offload_size,
                state_snapshot_interval=self.state_snapshot_interval, max_state_snapshots=self.max_state_snapshots,
            ),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      scheduling_policy=self.scheduling_policy,
                                      priority_aging_steps=self.priority_aging_steps),
            device=DeviceConfig(device=self.device, attention_backend=self.attention_backend,
                                num_threads=self.num_threads, tensor_parallel_size=self.tensor_parallel_size,
                                pipeline_parallel_size=self.pipeline_parallel_size, cpu_bind=self.cpu_bind,
                                nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
                                master_port=self.master_port,
                                distributed_executor_backend=self.distributed_executor_backend),
            limits=LimitsConfig(max_n=self.max_n, max_logprobs=self.max_logprobs,
                                max_stop_strings=self.max_stop_strings,
                                grammar_compile_timeout_s=self.grammar_compile_timeout,
                                max_grammar_chars=self.max_grammar_chars,
                                max_images_per_prompt=images_per_prompt(self.limit_mm_per_prompt),
                                max_image_pixels=self.max_image_pixels),
            kernels=KernelConfig.from_env(isa=self.cpu_isa, cpu_kernels=self.cpu_kernels, gemm=self.gemm),
            speculative=SpeculativeConfig.parse(self.speculative_config),
            pooler=PoolerConfig.parse(self.pooler_config),
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None,
        )  # fmt: skip

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options parsed by :func:`add_engine_args` (those it did not add keep their defaults)."""
        return cls(**cli_engine_options(args))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def images_per_prompt(limit_mm_per_prompt: str | Mapping[str, int] | None) -> int:
    """The images one prompt may hold, from vLLM's ``--limit-mm-per-prompt`` JSON or its offline
    dict (None: the default); ValueError naming what is wrong with it."""
    if limit_mm_per_prompt is None:
        return LimitsConfig.max_images_per_prompt
    limits: object = limit_mm_per_prompt
    if isinstance(limit_mm_per_prompt, str):
        try:
            limits = json.loads(limit_mm_per_prompt)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not JSON: {exc}") from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f'limit_mm_per_prompt must be an object of the modalities pagellm takes ("image"), got {limits!r}')
    value = limits.get("image", LimitsConfig.max_images_per_prompt)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"limit_mm_per_prompt's image limit must be a non-negative integer, got {value!r}")
    return value


ENGINE_OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(EngineArgs))


def cli_engine_options(args: argparse.Namespace, names: Iterable[str] = ENGINE_OPTION_NAMES) -> dict[str, Any]:
    """The engine options among ``names`` that a parsed command line gave; None means not given
    (the engine's default)."""
    return {name: value for name in names if (value := getattr(args, name, None)) is not None}


def add_engine_args(
    parser: argparse.ArgumentParser, names: Iterable[str] | None = None, defaults: Mapping[str, Any] | None = None,
    positional_model: bool = True,
) -> None:
    """Add the flags of ``EngineArgs`` fields (``names``: a subset, in declaration order) to
    ``parser``, in their groups; ``defaults`` replaces fields' defaults (None: "the engine's
    default", for a benchmark that passes on only what was given); the model is a positional
    argument unless ``positional_model`` is False (then ``--model``)."""
    wanted = set(ENGINE_OPTION_NAMES if names is None else names)
    unknown = wanted - set(ENGINE_OPTION_NAMES)
    if unknown:
        raise ValueError(f"not engine options: {sorted(unknown)}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(EngineArgs):
        if f.name not in wanted:
            continue
        meta = f.metadata
        default = f.default if f.default is not MISSING else None
        if defaults is not None and f.name in defaults:
            default = defaults[f.name]
        if f.name == "model" and positional_model:
            parser.add_argument("model", nargs="?", default=default, help=meta["help"].replace("%", "%%"))
            continue
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        help = meta["help"] if default == f.default or default is None else f"{meta['help']} (default here: {default})"
        kwargs: dict[str, Any] = {"default": default, "help": help.replace("%", "%%")}  # argparse formats help with %
        if meta["flag"]:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if meta["kind"] is not None:
                kwargs["type"] = meta["kind"]
            if meta["choices"] is not None:
                kwargs["choices"] = meta["choices"]
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)
