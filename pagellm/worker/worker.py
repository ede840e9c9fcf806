"""The worker: everything on the device side of the engine, set up once.

It owns the device and its threads, the kernel plan and the dtype it fixes, the model and its
weights, the KV cache's size and tensors, and the model runner that executes a step. The engine
above it keeps only bookkeeping (schedule -> execute -> update -> output) and learns the
worker's facts (blocks, context limit) from its attributes, so an executor can later drive
several workers through the same two calls: construction and :meth:`Worker.execute`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from pagellm.attention import get_attention_backend
from pagellm.config import (
    DeviceConfig, EngineConfig, ModelConfig, draft_model_config, resolve_dtype, resolve_kv_cache_dtype,
)
from pagellm.disk_tier_files import TierLayout
from pagellm.distributed.parallel_state import ParallelRank
from pagellm.distributed.pipeline import stage_layers
from pagellm.kernels.plan import KernelPlan
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.interface import CausalLM
from pagellm.model.loader import (
    auto_dtype, is_gguf, load_arch_config, load_model, load_vision_encoder, requested_weights, resolve_model_path,
    single_threaded,
)
from pagellm.model.packed_weights_cache import PackedWeightsCache
from pagellm.step import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagellm.utils import cdiv
from pagellm.worker.device import auto_dtype_downcasts_float32, available_memory_bytes, configure_threads, resolve_device
from pagellm.worker.kernel_plan import plan_kernels
from pagellm.worker.kv_budget import (
    AutoPool, HostShare, auto_kv_blocks, auto_kv_budget, check_pool_fits, check_weights_fit, estimated_weight_bytes,
    gib, step_workspace_bytes, useful_kv_blocks,
)
from pagellm.worker.kv_cache import (
    allocate_kv_cache,
    attention_layers_in,
    bytes_per_block,
    checkpoint_rows_from,
    num_blocks_for_budget,
    scan_snapshot_rows,
    state_slot_bytes,
    state_snapshot_bytes,
    with_recurrent_states,
)
from pagellm.worker.disk_tier_io import DiskTierIO
from pagellm.worker.disk_tier_key import tier_layout
from pagellm.worker.draft_model_source import DraftModelSource
from pagellm.worker.drafter import Drafter
from pagellm.worker.mtp_source import MtpSource
from pagellm.worker.encoder_runner import EncoderRunner
from pagellm.worker.lora_manager import LoRAManager
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def engine_kernel_plan(config: EngineConfig, device: torch.device) -> KernelPlan:
    """The kernel plan an engine with ``config`` runs on ``device``, its dtype resolved ("auto"
    as in ``auto_dtype``, knowing whether the plan multiplies bf16 fast here)."""

    def choose_dtype(bf16_is_fast: bool) -> torch.dtype:
        return resolve_dtype(config.model.dtype) or auto_dtype(
            config.model.model, bf16_is_fast, auto_dtype_downcasts_float32(device)
        )

    weights = requested_weights(config.model)
    plan = plan_kernels(config.kernels, device, config.device.attention_backend, choose_dtype, weights)
    return dataclasses.replace(plan, lora=config.lora is not None)


def engine_dtype(dtype: str | torch.dtype, model: str | None, device: torch.device) -> torch.dtype:
    """The dtype an engine with default kernel options runs ``model`` in on ``device``."""
    config = EngineConfig(model=ModelConfig(model=model, dtype=dtype), device=DeviceConfig(device=device.type))
    return engine_kernel_plan(config, device).dtype


class LoadedDraft(NamedTuple):
    """A draft model (speculative method "draft_model") as loaded, before its KV cache."""

    plan: KernelPlan
    model: CausalLM
    arch: ModelArchConfig


def draft_engine_config(config: EngineConfig) -> EngineConfig | None:
    """The configuration the draft model loads with (None: no draft model)."""
    if config.speculative is None or not config.speculative.uses_draft_model:
        return None
    return dataclasses.replace(config, model=draft_model_config(config), speculative=None)


def host_share(config: EngineConfig, parallel: ParallelRank | None) -> HostShare:
    """This engine's ranks on this host and the data-parallel replicas beside it."""
    ranks = 1 if parallel is None else max(1, parallel.world_size // config.device.nnodes)
    replica, replicas = config.device.cpu_share
    return HostShare(ranks=ranks, replicas=replicas, replica=replica)


def host_weight_bytes(config: EngineConfig, plan: KernelPlan, parallel: ParallelRank | None, share: HostShare) -> int:
    """About what this engine's weights take on this host (its ranks' shares of them), read from
    the model's shape and file before any weight is."""
    path = resolve_model_path(config.model.model)
    file_bytes = os.path.getsize(path) if is_gguf(path) else None
    whole = estimated_weight_bytes(load_arch_config(config.model.model), plan.weights, plan.dtype, file_bytes)
    if parallel is None:
        return whole
    return whole * share.ranks // parallel.world_size


def packed_weights_cache(
    config: EngineConfig, plan: KernelPlan, device: torch.device, role: str
) -> PackedWeightsCache | None:
    """Where the packed weights of ``config``'s GGUF model are kept between starts for ``role``
    (the model or its draft, a rank's share), or None: not packed from the file here, or not kept."""
    if device.type != "cpu" or plan.weights != "gguf" or plan.kernels is None:
        return None
    path = resolve_model_path(config.model.model)
    return PackedWeightsCache.for_model(path, config.model.packed_weights_cache_bytes, plan.kernels.build_id, role)


def _model_name(config: EngineConfig) -> str:
    return config.model.model or "the default model"


def _agreed_minimum(value: int, parallel: ParallelRank | None) -> int:
    """The smallest ``value`` over all ranks (every rank's pool has the same blocks)."""
    if parallel is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def rank_shard(arch: ModelArchConfig, parallel: ParallelRank | None) -> ModelArchConfig:
    """A rank's tensor-parallel share of each layer's heads and channels (every layer index kept)."""
    return arch if parallel is None else arch.shard(parallel.tp_size)


def rank_layers(arch: ModelArchConfig, parallel: ParallelRank | None) -> tuple[range, tuple[range, ...]]:
    """The layers this rank holds (its pipeline stage's, else all), and every stage's: each rank
    sizes its pool's blocks alike, for the stage whose block holds the most (the block ids are
    shared)."""
    if parallel is None or parallel.pp_size == 1:
        return range(arch.num_hidden_layers), (range(arch.num_hidden_layers),)
    stages = tuple(range(start, end) for start, end in stage_layers(arch.num_hidden_layers, parallel.pp_size))
    return stages[parallel.stage_index], stages


def context_limit(
    requested: int | None, arch: ModelArchConfig, num_blocks: int, block_size: int, step_tokens: int
) -> int:
    """The model's limit (or the one asked for), never more than the KV pool holds for one
    request; a request for more than either is an error naming both. Where every layer keeps
    one sliding window, a request holds only the blocks its window and one step's new tokens
    (at most ``step_tokens``) span, the rest released behind it: once the pool holds those,
    it bounds nothing."""
    pool_tokens = num_blocks * block_size
    window = arch.window_of_every_layer
    if window is not None and cdiv(window - 1 + step_tokens, block_size) + 1 <= num_blocks:
        pool_tokens = max(pool_tokens, arch.context_length)
    if requested is None:
        return min(arch.context_length, pool_tokens)
    if requested > pool_tokens:
        raise ValueError(
            f"max_model_len={requested} does not fit in the KV cache ({num_blocks} blocks of {block_size} tokens = "
            f"{pool_tokens} tokens); raise kv_cache_memory or lower max_model_len"
        )
    if requested > arch.context_length:
        raise ValueError(f"max_model_len={requested} is longer than the model's context ({arch.context_length} positions)")
    return requested


class Worker:
    """The device side of one engine (see the module docstring). ``tokenizer_eos_token_id``:
    the tokenizer's end-of-sequence id, if it has one, an EOS beside the model's own.
    ``parallel``: this worker is one rank of several (its share of each layer and of each KV
    block's heads under tensor parallelism, its stage's layers under pipeline parallelism;
    ``worker/multiproc_executor.py`` starts the ranks). ``micro_batches``: what a pipeline
    stage cuts each step into (``distributed/pipeline.py``)."""

    def __init__(
        self, config: EngineConfig, tokenizer_eos_token_id: int | None = None, parallel: ParallelRank | None = None,
        micro_batches: int = 1,
    ) -> None:
        self.device = resolve_device(config.device.device)
        configure_threads(self.device, config.device.num_threads)
        torch.manual_seed(config.model.seed)
        self.kernel_plan = engine_kernel_plan(config, self.device)
        logger.info("kernel plan: %s", self.kernel_plan.describe())
        attn_backend = get_attention_backend(self.kernel_plan.attention, self.device, self.kernel_plan.kernels)
        share = host_share(config, parallel)
        weight_bytes = host_weight_bytes(config, self.kernel_plan, parallel, share)
        draft_config = draft_engine_config(config)
        draft_plan = None if draft_config is None else engine_kernel_plan(draft_config, self.device)
        if draft_config is not None and draft_plan is not None:
            logger.info("draft model's kernel plan: %s", draft_plan.describe())
            # (every rank on this host loads the whole draft model)
            weight_bytes += host_weight_bytes(draft_config, draft_plan, None, share) * share.ranks
        check_weights_fit(_model_name(config), weight_bytes, available_memory_bytes(self.device), share)
        role = "model" if parallel is None else f"model rank {parallel.rank} of {parallel.tp_size}x{parallel.pp_size}"
        packs = packed_weights_cache(config, self.kernel_plan, self.device, role)
        mtp = config.speculative is not None and config.speculative.uses_mtp  # (its layer loads with the model)
        model, self.arch = load_model(config.model.model, self.dtype, attn_backend, self.device, self.kernel_plan,
                                      parallel, packs, mtp)  # fmt: skip
        # Weights served from a cache file's pages: the memory reported as available counts them.
        self.mapped_weight_bytes = 0 if packs is None else packs.mapped_bytes
        # The weights repacked once for the plan's CPU kernels (fused MLPs, packed linears).
        self.cpu_optimizations = self._optimize(model, self.kernel_plan)
        # A vision-language model's encoder, where the rank embeds tokens (every tensor-parallel
        # rank, whole: its images' rows enter every rank's share; the first pipeline stage).
        stage = None if parallel is None else parallel.stage(self.arch.num_hidden_layers)
        embeds = stage is None or stage.is_first
        vision = None if not embeds else load_vision_encoder(
            config.model.model, self.dtype, self.device, self.kernel_plan.kernels if self.device.type == "cpu" else None)
        draft = None
        if draft_config is not None and draft_plan is not None:
            draft = self._load_draft(draft_config, draft_plan)
        # The adapters' slots, allocated before the KV pool is sized from the memory left.
        lora = None if config.lora is None else LoRAManager(
            config.lora, self.arch, self.dtype, self.device, parallel.tp if parallel is not None else None,
            self.kernel_plan.kernels if self.device.type == "cpu" else None,
        )
        # The ids that end a sequence (min_tokens masks them while sampling): the model's and the tokenizer's.
        extra = () if tokenizer_eos_token_id is None else (tokenizer_eos_token_id,)
        self.eos_token_ids = frozenset((*self.arch.eos_token_ids, *extra))
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        # Every rank sizes its pool alike (the block ids are shared): for its heads and the
        # biggest stage's layers.
        shard = rank_shard(self.arch, parallel)
        own, stages = rank_layers(self.arch, parallel)
        # The MTP layer's K/V: one more attention layer of the target's shape in every block.
        mtp_block_bytes = bytes_per_block(1, shard.num_key_value_heads, shard.head_dim, self.block_size,
                                          self.kv_cache_dtype, shard.kv_values_stored) if mtp else 0  # fmt: skip
        draft_block_bytes = mtp_block_bytes
        if draft is not None:
            draft_kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, draft.plan.dtype)
            draft_block_bytes = bytes_per_block(draft.arch.num_hidden_layers, draft.arch.num_key_value_heads,
                                                draft.arch.head_dim, self.block_size, draft_kv_dtype,
                                                draft.arch.kv_values_stored)  # fmt: skip
        self.num_blocks = self._pool_blocks(config, shard, own, stages, parallel, share, weight_bytes,
                                            draft_block_bytes)  # fmt: skip
        self.max_model_len = context_limit(config.model.max_model_len, self.arch, self.num_blocks, self.block_size,
                                           config.scheduler.max_num_batched_tokens)  # fmt: skip
        kv_cache = allocate_kv_cache(
            attention_layers_in(shard, own), self.num_blocks, self.block_size,
            shard.num_key_value_heads, shard.head_dim, self.kv_cache_dtype, self.device, shard.kv_values_stored,
        )  # fmt: skip
        slots = config.scheduler.max_num_seqs
        kv_cache = with_recurrent_states(shard, kv_cache, slots, self.num_blocks, self.dtype, self.device,
                                         scan_snapshot_rows(shard, config.state_snapshot_rows),
                                         slots if checkpoint_rows_from(shard, config) is not None else 0,
                                         layers=own)  # fmt: skip
        mtp_cache = allocate_kv_cache(1, self.num_blocks, self.block_size, shard.num_key_value_heads, shard.head_dim,
                                      self.kv_cache_dtype, self.device, shard.kv_values_stored) if mtp else []  # fmt: skip
        # The disk tier's folder and entry size (the engine's index reads it; None: no tier).
        self.disk_tier: TierLayout | None = None
        disk_tier = None
        if config.cache.kv_offload_dir is not None:
            self.disk_tier, folder_lock = tier_layout(
                config, self.arch, self.kernel_plan_info, self.kv_cache_dtype,
                bytes_per_block(attention_layers_in(shard, own), shard.num_key_value_heads, shard.head_dim,
                                self.block_size, self.kv_cache_dtype, shard.kv_values_stored) + mtp_block_bytes,
                self.device,
            )  # fmt: skip
            disk_tier = DiskTierIO(kv_cache + mtp_cache, self.disk_tier, folder_lock)
        link = parallel.link(self.arch.hidden_size, self.dtype, self.arch.num_hidden_layers) if parallel else None
        drafter = None
        if mtp:
            busy_above = config.speculative.disable_by_batch_size if config.speculative is not None else None
            drafter = Drafter(MtpSource(model, mtp_cache, self.block_size, self.device,  # type: ignore[arg-type]
                                        self.kernel_plan.library("argmax"), busy_above))  # fmt: skip
        if draft is not None:
            draft_cache = allocate_kv_cache(draft.arch.num_hidden_layers, self.num_blocks, self.block_size,
                                            draft.arch.num_key_value_heads, draft.arch.head_dim, draft_kv_dtype,
                                            self.device, draft.arch.kv_values_stored)  # fmt: skip
            drafter = Drafter(DraftModelSource(draft.model, draft_cache, self.block_size, self.device,
                                               draft.plan.library("argmax"), config.scheduler.max_num_batched_tokens,
                                               draft.arch.vocab_size, self.num_blocks))  # fmt: skip
        self.model_runner = ModelRunner(
            model, kv_cache, self.block_size, self.device, sorted(self.eos_token_ids), self.kernel_plan,
            samples=parallel is None or parallel.samples, link=link, micro_batches=micro_batches, drafter=drafter,
            lora=lora, encoder=None if vision is None else EncoderRunner(vision, self.device),
            disk_tier=disk_tier,
        )

    def _available_memory(self, share: HostShare) -> int | None:
        """The memory available now that the weights are in: the host's, less the weights its
        ranks map from packed-weights files (page cache, which the host counts as available)."""
        available = available_memory_bytes(self.device)
        return None if available is None else available - self.mapped_weight_bytes * share.ranks

    def _optimize(self, model: CausalLM, plan: KernelPlan) -> dict[str, int]:
        """Repack ``model``'s weights once for the plan's CPU kernels (fused MLPs, packed linears)."""
        if self.device.type != "cpu":
            return {}
        with single_threaded():
            return model.optimize_for_cpu_inference(plan)

    def _load_draft(self, config: EngineConfig, plan: KernelPlan) -> LoadedDraft:
        """The draft model (speculative method "draft_model"), checked against the target: the
        same vocabulary (ids the target knows), and every block kept (no window releasing them)."""
        backend = get_attention_backend(plan.attention, self.device, plan.kernels)
        packs = packed_weights_cache(config, plan, self.device, "draft")
        model, arch = load_model(config.model.model, plan.dtype, backend, self.device, plan, None, packs)
        self.mapped_weight_bytes += 0 if packs is None else packs.mapped_bytes
        if arch.vocab_size > self.arch.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({arch.vocab_size} ids) is larger than the target's "
                             f"({self.arch.vocab_size}); a draft model needs the target's tokenizer")  # fmt: skip
        if self.arch.window_of_every_layer is not None:
            raise ValueError("a draft model needs every KV block of the target kept; this target releases blocks "
                             "behind its sliding window (use 'ngram')")  # fmt: skip
        if arch.recurrent_layers:
            raise ValueError(f"the draft model {arch.architecture} has recurrent layers: a draft "
                             "model with them is not supported yet")  # fmt: skip
        self._optimize(model, plan)
        return LoadedDraft(plan, model, arch)

    def _pool_blocks(
        self, config: EngineConfig, shard: ModelArchConfig, own: range, stages: tuple[range, ...],
        parallel: ParallelRank | None, share: HostShare, weight_bytes: int, draft_block_bytes: int = 0,
    ) -> int:
        """The pool's block count: the exact number asked for, else what the memory budget
        holds, else (``auto``) what the memory left once every rank's weights are in holds.
        A draft model's layers or the MTP layer take their share of every block
        (``draft_block_bytes``); a block is sized for the stage whose block holds the most (its
        K/V and state snapshots), the recurrent states for this rank's own layers (``own``)."""
        cache = config.cache

        def stage_block_bytes(layers: range) -> int:
            attention = bytes_per_block(attention_layers_in(shard, layers), shard.num_key_value_heads, shard.head_dim,
                                        cache.block_size, self.kv_cache_dtype, shard.kv_values_stored)  # fmt: skip
            return attention + state_snapshot_bytes(shard, self.dtype, layers)  # (each block's state snapshots)

        block_bytes = draft_block_bytes + max(map(stage_block_bytes, stages))
        scheduler = config.scheduler
        snapshot_rows = scan_snapshot_rows(shard, config.state_snapshot_rows)
        # A hybrid model's recurrent states, beside the pool: a row a sequence (and a checkpoint
        # row each under speculative decoding) and a snapshot row each.
        checkpoints = checkpoint_rows_from(shard, config) is not None
        slot_rows = scheduler.max_num_seqs * (2 if checkpoints else 1)
        states = dict(state_bytes=state_slot_bytes(shard, slot_rows + snapshot_rows, self.dtype, own),
                      state_slots=scheduler.max_num_seqs, state_snapshots=snapshot_rows,
                      state_checkpoints=checkpoints)  # fmt: skip
        if cache.num_kv_blocks is not None or cache.kv_cache_bytes is not None:
            blocks = cache.num_kv_blocks or num_blocks_for_budget(cache.kv_cache_bytes, block_bytes)
            check_pool_fits(blocks * block_bytes, self._available_memory(share), share, **states)
            return blocks
        if parallel is not None:
            dist.barrier()  # every rank's weights in before any measures
        available = self._available_memory(share)
        if available is None:
            raise ValueError("kv_cache_memory='auto' needs to know the memory available, which this host does not say; "
                             "give kv_cache_memory a size")  # fmt: skip
        context = config.model.max_model_len or self.arch.context_length
        pool = AutoPool(
            available=available, host_weight_bytes=weight_bytes, block_bytes=block_bytes,
            workspace=step_workspace_bytes(self.arch, scheduler.max_num_batched_tokens, scheduler.max_num_seqs),
            **states,
            useful_blocks=useful_kv_blocks(scheduler.max_num_seqs, context, cache.block_size),
        )  # fmt: skip
        # Every rank takes the smallest budget, so all size alike and any refusal is every rank's.
        budget = _agreed_minimum(auto_kv_budget(pool, share), parallel)
        blocks = auto_kv_blocks(budget, pool, share, _model_name(config))
        logger.info("KV cache (auto): %s available once the weights are in -> %d blocks of %d tokens (%s)",
                    gib(available), blocks, cache.block_size, gib(blocks * block_bytes))  # fmt: skip
        return blocks

    pipeline_depth = 1  # one step at a time

    @property
    def kernel_plan_info(self) -> dict[str, str]:
        """The kernel plan as plain strings."""
        return self.kernel_plan.as_dict()

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype (the kernel plan's)."""
        return self.kernel_plan.dtype

    def execute(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """Run one step's model pass: block copies, forward, sampling (within each constrained
        sequence's allowed tokens)."""
        return self.model_runner.execute(scheduler_output, grammar_bitmask)

    def sentinels(self) -> list[int]:
        """No other processes: nothing to watch."""
        return []

    def check_health(self) -> None:
        """One process: alive as long as its caller is (failures surface as exceptions)."""

    def close(self) -> None:
        """Finish the disk tier's writes; the rest lives and ends with this process."""
        if self.model_runner.disk_tier is not None:
            self.model_runner.disk_tier.close()
