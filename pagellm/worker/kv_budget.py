"""How big the KV pool is, and whether a model fits at all.

``kv_cache_memory`` is a size (``"2GiB"``) or ``"auto"``, the default: what memory is left once
the weights are in, less a step's activations and a margin for the runtime, shared by the
ranks and data-parallel replicas that size their pools on this host, and never more than the
scheduler could ever fill (``max_num_seqs`` requests of the model's whole context). The pool's
pages are only touched as blocks are first written, so a large pool costs no start-up time.

Before any weight is read, an estimate of what they will take is checked against the memory
available, so a model that cannot fit is an error naming both numbers, not a process killed
halfway through loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.model.arch_config import ModelArchConfig

# Of the memory available once the weights are in, the pool takes this share: the rest stays
# for the runtime (Python, the tokenizer, request state) and for the rest of the machine.
AUTO_KV_SHARE = 0.9
_GIB = float(1 << 30)


def gib(size: int | float) -> str:
    """``size`` bytes as GiB with two decimals (for error messages and logs)."""
    return f"{size / _GIB:.2f} GiB"


@dataclass(frozen=True)
class HostShare:
    """The processes that take their memory from this host beside this one: this engine's
    ranks here (they load together and measure once all have loaded), and the data-parallel
    replicas (each its own engine, started one after another; this one is ``replica``)."""

    ranks: int = 1
    replicas: int = 1
    replica: int = 0

    @property
    def count(self) -> int:
        return self.ranks * self.replicas

    @property
    def replicas_after(self) -> int:
        """Replicas that load their weights after this one (their memory is not taken yet)."""
        return self.replicas - 1 - self.replica

    def describe(self) -> str:
        parts = [f"{self.ranks} ranks"] if self.ranks > 1 else []
        parts += [f"{self.replicas} replicas"] if self.replicas > 1 else []
        return " x ".join(parts) or "one process"


def step_workspace_bytes(arch: ModelArchConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The most a step's activations take (float32, generous): a full token budget's widest rows
    (the residual, q/k/v, the MLP's gate and up) and the logits of every sampled row, twice (the
    sampler's working copy)."""
    width = 2 * arch.hidden_size + arch.q_size + 2 * arch.kv_size + 2 * arch.intermediate_size
    return 4 * (max_num_batched_tokens * width + 2 * max_num_seqs * arch.vocab_size)


def estimated_weight_bytes(arch: ModelArchConfig, weights: str, dtype: torch.dtype, gguf_file_bytes: int | None) -> int:
    """What a whole model's weights take in memory once loaded for a plan that holds them as
    ``weights`` (``KernelPlan.weights``): a GGUF file's blocks about as the file holds them,
    int8 linears at one byte a weight and their scales, dense ones at the compute dtype."""
    if weights == "gguf" and gguf_file_bytes is not None:
        return gguf_file_bytes
    itemsize = torch.empty((), dtype=dtype).element_size()
    linears = arch.linear_weight_count()
    embedding = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    per_weight = 1.0625 if weights == "int8" else itemsize  # int8 blocks: an fp16 scale per 32 weights
    return int(linears * per_weight + embedding * itemsize)


def check_weights_fit(model: str, host_weight_bytes: int, available: int | None, share: HostShare) -> None:
    """Refuse a model whose weights cannot fit (``available``: None where the host does not say).
    ``host_weight_bytes``: what this engine's ranks on this host load together; the replicas
    still to start after this one need as much each."""
    if available is None:
        return
    need = host_weight_bytes * (1 + share.replicas_after)
    if need > available:
        who = f" ({share.describe()})" if share.count > 1 else ""
        raise ValueError(
            f"{model} does not fit: its weights need about {gib(need)}{who}, but {gib(available)} of memory "
            "is available; free memory, or choose a smaller or more quantized model"
        )


@dataclass(frozen=True)
class AutoPool:
    """What an ``auto`` pool is sized from (bytes; ``useful_blocks``: :func:`useful_kv_blocks`)."""

    available: int  # measured once this engine's weights are in
    host_weight_bytes: int  # one replica's weights on this host (the later replicas' still to come)
    workspace: int  # one rank's step activations (:func:`step_workspace_bytes`)
    block_bytes: int
    useful_blocks: int
    # A hybrid model's recurrent states (``worker/kv_cache.py`` ``state_slot_bytes``), one rank's:
    # ``state_slots`` rows (``max_num_seqs``), as many checkpoint rows under speculative decoding
    # (``state_checkpoints``) and ``state_snapshots`` rows (a model with scan layers: its prefix
    # cache's), allocated beside the pool.
    state_bytes: int = 0
    state_slots: int = 0
    state_snapshots: int = 0
    state_checkpoints: bool = False


def auto_kv_budget(pool: AutoPool, share: HostShare) -> int:
    """This process's pool bytes under ``kv_cache_memory="auto"`` (below one block, or negative,
    where nothing is left): ``AUTO_KV_SHARE`` of the memory the host will have once every
    replica's weights are in, less every process's step workspace, split evenly."""
    free = pool.available - pool.host_weight_bytes * share.replicas_after
    return int((AUTO_KV_SHARE * free - (pool.workspace + pool.state_bytes) * share.count) / share.count)


def auto_kv_blocks(budget: int, pool: AutoPool, share: HostShare, model: str) -> int:
    """The blocks ``budget`` (:func:`auto_kv_budget`, the same on every rank) holds, capped at
    what could ever be used; an error naming the numbers where not one block is left."""
    if budget < pool.block_bytes:
        free = pool.available - pool.host_weight_bytes * share.replicas_after
        who = f" for {share.describe()}" if share.count > 1 else ""
        named = _states_named(pool.state_bytes, pool.state_slots, pool.state_snapshots, pool.state_checkpoints)
        states = f", {named} (lower them)" if pool.state_bytes else ""
        raise ValueError(
            f"{model} leaves no room for a KV cache: once the weights are in, {gib(free)} of memory is left{who}, "
            f"a step's activations need about {gib(pool.workspace)} a process{states}, and one KV block needs "
            f"{pool.block_bytes} bytes; free memory, give kv_cache_memory a size, or choose a smaller model"
        )
    return min(budget // pool.block_bytes, pool.useful_blocks)


def check_pool_fits(
    pool_bytes: int, available: int | None, share: HostShare, state_bytes: int = 0, state_slots: int = 0,
    state_snapshots: int = 0, state_checkpoints: bool = False,
) -> None:
    """Refuse a pool asked for by size or block count (``kv_cache_memory``, ``num_kv_blocks``)
    that the memory available once the weights are in cannot hold, with a hybrid model's
    recurrent states beside it (as :class:`AutoPool` counts them): every rank here and every
    replica still to start takes one as large."""
    copies = share.ranks * (1 + share.replicas_after)
    if available is not None and (pool_bytes + state_bytes) * copies > available:
        who = f" ({share.describe()})" if share.count > 1 else ""
        named = _states_named(state_bytes, state_slots, state_snapshots, state_checkpoints)
        beside = f" and {named}" if state_bytes else ""
        raise ValueError(
            f"the KV cache asked for needs {gib(pool_bytes * copies)}{who}{beside}, but {gib(available)} of memory is "
            "available once the weights are in; give kv_cache_memory a smaller size, or 'auto'"
        )


def _states_named(state_bytes: int, state_slots: int, state_snapshots: int, state_checkpoints: bool) -> str:
    """A hybrid model's recurrent states, what sets their number, and their memory."""
    checkpoints = " twice over (speculative decoding keeps a checkpoint of each)" if state_checkpoints else ""
    snapshots = f" and {state_snapshots} prefix-cache snapshots (max_state_snapshots)" if state_snapshots else ""
    return (f"its recurrent states for {state_slots} sequences (max_num_seqs){checkpoints}{snapshots} need "
            f"{gib(state_bytes)}")  # fmt: skip


def useful_kv_blocks(max_num_seqs: int, context_length: int, block_size: int) -> int:
    """The most blocks the scheduler could ever hold: every running request at the model's whole
    context (an ``auto`` pool larger than this would never be used)."""
    return max_num_seqs * -(-context_length // block_size)
