"""Engine configuration: a few dataclasses, validated once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from pagellm.lora_config import LoRAConfig
from pagellm.pooler_config import PoolerConfig
from pagellm.speculative_config import SpeculativeConfig
from pagellm.utils import is_real, parse_memory_size

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# --kv-cache-dtype: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3", as in vLLM)
# stores float8_e4m3fn with no scaling, half the bytes of bf16 per token; "int8" stores each
# (token, head) row as int8 codes and a float32 scale (amax / 127) after them: head_dim + 4 bytes
# a head (pagellm/kv_layout.py), about half of bf16's.
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
KV_CACHE_DTYPE_CHOICES = ("auto", *_KV_CACHE_DTYPES)


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V are stored in: the model's for "auto", else the named fp8 or int8 format."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(
            f"unsupported kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}"
        )
    return _KV_CACHE_DTYPES[kv_cache_dtype]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """Map the user's dtype choice to a torch dtype; ``None`` for "auto".

    "auto" depends on the checkpoint and the device, so the engine resolves it when it loads
    the model (:func:`pagellm.model.loader.auto_dtype`): bfloat16 for 16-bit checkpoints
    (and GGUF) where the kernel plan multiplies bf16 fast, and on CUDA for float32 checkpoints
    too; float32 otherwise.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose float32 or bfloat16")
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


# --quantization: "auto" keeps a quantized GGUF file's blocks (Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1
# and Q4_K / Q5_K / Q6_K as they are, other types as int8 blocks) unless the dtype is float32 (then every weight is
# dequantized: the exact reference path); "none" dequantizes; "gguf" is auto made required;
# "int8" quantizes any checkpoint's linears to int8 blocks at load.
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8")


@dataclass
class ModelConfig:
    """What to load: weights, tokenizer and numeric type."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None  # None: the model's own limit, capped by the KV pool
    seed: int = 0
    chat_template: str | None = None  # path of a Jinja file overriding the model's template
    quantization: str = "auto"  # QUANTIZATION_CHOICES
    # The most the GGUF files' packed weights kept between starts take (model/packed_weights_cache.py; 0: none).
    packed_weights_cache_size: int | str = "16GiB"
    packed_weights_cache_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        size = self.packed_weights_cache_size
        off = size in ("0", "off") or (type(size) is int and size == 0)
        try:
            self.packed_weights_cache_bytes = 0 if off else parse_memory_size(size)
        except ValueError as exc:
            raise ValueError(f"packed_weights_cache_size: {exc} (0 turns the cache off)") from None
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")
        resolve_dtype(self.dtype)  # fail early on a bad name; "auto" is resolved when the model loads
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """How big the paged KV cache is and how it is cut into blocks."""

    block_size: int = 16
    kv_cache_memory: int | str = "auto"  # a size, or "auto": what memory the weights leave (worker/kv_budget.py)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests, benchmarks)
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # or "fp8" / "fp8_e4m3" / "int8": see resolve_kv_cache_dtype
    kv_offload_dir: str | None = None  # the disk tier's folder (None: no disk tier; core/disk_tier.py)
    kv_offload_size: int | str = "16GiB"  # the most the disk tier's entries take
    # A model with scan layers (Mamba-2, gated delta-net): its prefix cache resumes only where a
    # snapshot of every scan layer's state was kept (``core/state_snapshots.py``): at every
    # ``state_snapshot_interval`` tokens of a prompt (None: the first multiple of ``block_size``
    # from 512) and at its last full block, at most ``max_state_snapshots`` of them (None:
    # ``max(4, max_num_seqs // 4)``; 0: no prefix cache).
    state_snapshot_interval: int | None = None
    max_state_snapshots: int | None = None
    kv_cache_bytes: int | None = field(init=False)  # None: auto
    kv_offload_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        auto = isinstance(self.kv_cache_memory, str) and self.kv_cache_memory.strip().lower() == "auto"
        self.kv_cache_bytes = None if auto else parse_memory_size(self.kv_cache_memory)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        self._check_state_snapshots()
        resolve_kv_cache_dtype(self.kv_cache_dtype, torch.float32)  # fail early on a bad name
        self.kv_offload_bytes = parse_memory_size(self.kv_offload_size)
        if self.kv_offload_dir is not None:
            if not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir.strip():
                raise ValueError(f"kv_offload_dir must be a folder's path, got {self.kv_offload_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_offload_dir keeps prefix-cached blocks on disk: it needs prefix caching on")


    def _check_state_snapshots(self) -> None:
        if self.state_snapshot_interval is None:
            self.state_snapshot_interval = -(-512 // self.block_size) * self.block_size
        interval, most = self.state_snapshot_interval, self.max_state_snapshots
        if not _is_int(interval) or interval < 1 or interval % self.block_size:
            raise ValueError(f"state_snapshot_interval must be a positive multiple of block_size ({self.block_size}), "
                             f"got {interval!r}")  # fmt: skip
        if most is not None and (not _is_int(most) or most < 0):
            raise ValueError(f"max_state_snapshots must be a non-negative integer, got {most!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SCHEDULING_POLICIES = ("fcfs", "priority")
# The priorities a request may carry (vLLM's: an integer, lower first).
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


@dataclass
class SchedulerConfig:
    """How much work one step may take, and in which order requests are served (``fcfs``, or
    ``priority``: lower first, aged one level every ``priority_aging_steps`` steps of waiting)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"
    priority_aging_steps: int = 1000

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")  # fmt: skip
        if isinstance(self.priority_aging_steps, bool) or not isinstance(self.priority_aging_steps, int) \
                or self.priority_aging_steps < 1:  # fmt: skip
            raise ValueError(f"priority_aging_steps must be an integer >= 1, got {self.priority_aging_steps!r}")


@dataclass
class LimitsConfig:
    """Per-request limits, checked once when a request arrives (each refusal names its field).

    They bound the work one request can ask of the engine: ``max_n`` caps ``n``, ``best_of``
    and the beam width (and is never above ``max_num_seqs``, what one step can run).
    """

    max_n: int = 128
    max_logprobs: int = 20  # top alternatives per position (vLLM's default cap)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    # A structured-outputs constraint still compiling after this long fails its request.
    grammar_compile_timeout_s: float = 10.0
    # The most characters of one constraint (schema, regex, grammar, choices): bounds the grammar
    # engine's time and recursion depth (pagellm.structured_output.grammar).
    max_grammar_chars: int = 128 * 1024
    # A vision-language model's prompt: the most images (0: none taken), and the most pixels of
    # one image (checked on its header, before its pixels are decoded).
    max_images_per_prompt: int = 8
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        at_least_0 = ("max_logprobs", "max_images_per_prompt")
        for name in ("max_n", "max_logprobs", "max_stop_strings", "max_stop_string_chars", "max_grammar_chars",
                     "max_images_per_prompt", "max_image_pixels"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name in at_least_0 else 1):
                kind = "a non-negative" if name in at_least_0 else "a positive"
                raise ValueError(f"{name} must be {kind} integer, got {value!r}")
        timeout = self.grammar_compile_timeout_s
        if not is_real(timeout) or not 0 < timeout < float("inf"):
            raise ValueError(f"grammar_compile_timeout_s must be a positive number of seconds, got {timeout!r}")


ISA_CHOICES = ("auto", "baseline", "avx2", "avx512", "amx")
GEMM_CHOICES = ("auto", "pagellm", "onednn", "torch")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelConfig:
    """Which CPU kernels the engine may use; the kernel plan is chosen from these at start-up.

    The defaults come from the environment, read here and nowhere else: ``PAGELLM_ISA``
    (``isa``), ``PAGELLM_CPU_KERNELS=0`` (``cpu_kernels``) and ``PAGELLM_KERNEL_MARCH``
    (``march``), so a test or a benchmark can force a path on a whole process tree.
    """

    isa: str = "auto"  # highest ISA level the kernels may use: auto (what the CPU has) or a cap
    cpu_kernels: bool = True  # False: PyTorch paths only (no C++ build)
    march: str | None = None  # the kernel build's -march (default: from the usable ISA level)
    gemm: str = "auto"  # linears (16-bit; float32 on AVX2): auto, pagellm (own GEMM), onednn, torch (F.linear)

    def __post_init__(self) -> None:
        if self.isa not in ISA_CHOICES:
            raise ValueError(f"isa must be one of {', '.join(ISA_CHOICES)}, got {self.isa!r}")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"gemm must be one of {', '.join(GEMM_CHOICES)}, got {self.gemm!r}")
        if self.march is not None and (not self.march or not all(c.isalnum() or c in "-_." for c in self.march)):
            raise ValueError(f"march must be a compiler -march value such as x86-64-v3, got {self.march!r}")

    @property
    def isa_cap(self) -> str:
        """The ISA level cap ("amx" means no cap)."""
        return "amx" if self.isa == "auto" else self.isa

    @classmethod
    def from_env(cls, **overrides: object) -> KernelConfig:
        """The configuration the environment asks for, with ``overrides`` (None: not given) on top."""
        values: dict[str, object] = {
            "isa": os.environ.get("PAGELLM_ISA", "auto").strip().lower() or "auto",
            "cpu_kernels": os.environ.get("PAGELLM_CPU_KERNELS", "1").strip().lower() not in _OFF,
            "march": os.environ.get("PAGELLM_KERNEL_MARCH") or None,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


CPU_BIND_CHOICES = ("auto", "none")
EXECUTOR_BACKENDS = ("mp", "ray")  # --distributed-executor-backend: processes here (and --nnodes), or Ray actors


@dataclass
class DeviceConfig:
    device: str = "cpu"
    attention_backend: str = "auto"
    num_threads: int | None = None  # None: torch's default (per rank: each rank's share)
    tensor_parallel_size: int = 1  # ranks (processes) that each hold a share of every layer
    pipeline_parallel_size: int = 1  # stages (groups of ranks) that each hold some of the layers
    cpu_bind: str = "auto"  # auto: each tensor-parallel rank on its own CPUs (a NUMA node each); none
    # (index, count): this engine's share of the CPUs its process may use, under cpu_bind auto
    # (data-parallel replicas take one share each; their tensor-parallel ranks split it).
    cpu_share: tuple[int, int] = (0, 1)
    # Several nodes (hosts): the ranks split evenly among them, node ``node_rank`` holding the
    # ``node_rank``-th share; every node's ranks meet at master_addr:master_port (node 0's).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # required with nnodes > 1 (one node: a free port is picked)
    distributed_executor_backend: str = "mp"  # EXECUTOR_BACKENDS

    def __post_init__(self) -> None:
        index, count = self.cpu_share
        if not 0 <= index < count:
            raise ValueError(f"cpu_share must be (index, count) with 0 <= index < count, got {self.cpu_share!r}")
        if self.cpu_bind not in CPU_BIND_CHOICES:
            raise ValueError(f"cpu_bind must be one of {CPU_BIND_CHOICES}, got {self.cpu_bind!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.world_size > 1 and self.device != "cpu":
            raise ValueError("tensor and pipeline parallelism run on CPU (gloo) in this version; use device='cpu'")
        self._check_nodes()
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")  # fmt: skip
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("with the ray backend, Ray places the ranks on its cluster's nodes: drop --nnodes")

    def _check_nodes(self) -> None:
        nnodes, port = self.nnodes, self.master_port
        if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
            raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {self.node_rank!r}")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
            raise ValueError(f"master_port must be a TCP port (1-65535), got {port!r}")
        if not self.master_addr or any(c.isspace() or c in "/@" for c in self.master_addr):
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if nnodes == 1:
            return
        if port is None:
            raise ValueError("several nodes need --master-port (the port node 0's ranks listen on)")
        if self.world_size % nnodes or (self.world_size // nnodes) % self.tensor_parallel_size:
            raise ValueError(f"the engine's {self.world_size} ranks (tensor x pipeline parallel) must split evenly "
                             f"over {nnodes} nodes, each node holding whole tensor-parallel groups")  # fmt: skip

    @property
    def local_world_size(self) -> int:
        """The ranks on this node."""
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        """The engine's ranks (processes): tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything the engine needs, in one validated bundle."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig.from_env)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # embeddings: what the flag sets (None: the model's)
    lora: LoRAConfig | None = None  # None: no LoRA adapters (--enable-lora)

    def __post_init__(self) -> None:
        if self.lora is not None:
            self._check_lora()
        if self.cache.kv_offload_dir is not None and self.device.world_size > 1:
            raise ValueError("kv_offload_dir (the disk tier) runs in a one-process engine only for now: not with tensor "
                             "or pipeline parallelism")  # fmt: skip
        spec = self.speculative
        if spec is not None and spec.uses_mtp and self.device.world_size > 1:
            raise ValueError("speculative method 'mtp' runs in a one-process engine only for now (not with tensor or "
                             "pipeline parallelism; use 'ngram')")  # fmt: skip
        if spec is not None and spec.uses_draft_model:
            if self.device.pipeline_parallel_size > 1:
                raise ValueError("speculative method 'draft_model' under pipeline parallelism is not supported (use "
                                 "'ngram', tensor or data parallelism)")  # fmt: skip
            # Every rank drafts for itself: ranks on one host run the same kernels on the same
            # inputs and draft alike; other nodes' CPUs might round differently.
            if self.device.world_size > 1 and (self.device.nnodes > 1 or self.device.distributed_executor_backend == "ray"):
                raise ValueError("speculative method 'draft_model' under tensor parallelism runs on one node's "
                                 "processes only (not with --nnodes or the ray backend)")  # fmt: skip
            draft_model_config(self)  # its quantization checked here, once


    @property
    def state_snapshot_rows(self) -> int:
        """The state snapshots a model with scan layers keeps for its prefix cache (0: none, the
        cache off): what ``max_state_snapshots`` asks, by default a quarter of ``max_num_seqs``."""
        if not self.cache.enable_prefix_caching:
            return 0
        most = self.cache.max_state_snapshots
        return max(4, self.scheduler.max_num_seqs // 4) if most is None else most

    def _check_lora(self) -> None:
        """What LoRA adapters do not run with yet, refused by name."""
        if self.device.pipeline_parallel_size > 1:
            raise ValueError("--enable-lora with pipeline parallelism is not supported yet (use tensor or data "
                             "parallelism)")  # fmt: skip


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """What the draft model of ``config.speculative`` loads: its checkpoint (the target's own
    where none is named), in its own quantization, its dtype what is fast here ("auto")."""
    spec = config.speculative
    if spec is None or not spec.uses_draft_model:
        raise ValueError("no draft model is configured")
    target = config.model
    model = spec.model if spec.model is not None else target.model
    if spec.model is None and spec.quantization == target.quantization:
        raise ValueError("a draft_model without its own 'model' drafts with the target's checkpoint and needs another "
                         f"'quantization' than the target's ({target.quantization!r}), e.g. the target with "
                         "quantization 'none' and the draft with 'gguf'")  # fmt: skip
    try:
        return ModelConfig(model=model, dtype="auto", seed=target.seed, quantization=spec.quantization,
                           packed_weights_cache_size=target.packed_weights_cache_size)  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"speculative_config: {exc}") from None


def split_threads(config: EngineConfig, parts: int) -> EngineConfig:
    """``config`` for one of ``parts`` processes sharing this machine (data-parallel replicas,
    tensor-parallel ranks): its share of the threads, the configured count or else this
    machine's cores, split evenly (at least one each)."""
    total = config.device.num_threads or os.cpu_count() or 1
    return replace(config, device=replace(config.device, num_threads=max(1, total // parts)))


def replica_configs(config: EngineConfig, size: int) -> list[EngineConfig]:
    """``size`` data-parallel replicas of an engine's configuration: each its share of the
    threads, and (under cpu_bind auto) its own share of the CPUs."""
    shares = [split_threads(config, size) for _ in range(size)]
    return [replace(c, device=replace(c.device, cpu_share=(i, size))) for i, c in enumerate(shares)]
