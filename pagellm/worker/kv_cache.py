"""The KV cache tensors: sizing from a memory budget, allocation, block copies; and a hybrid
model's recurrent states, one tensor a recurrent layer, one row a state slot."""

from __future__ import annotations

import math

import numpy as np
import torch

from pagellm.attention.backend import indexable
from pagellm.config import EngineConfig
from pagellm.kv_layout import kv_bytes_per_token, kv_row_width
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.scan_state import ScanState
from pagellm.model.short_conv import ConvState

# Per layer: (key_cache, value_cache) for an attention layer; a recurrent layer's states.
KVCache = list[tuple[torch.Tensor, torch.Tensor] | ConvState | ScanState]


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, values: bool = True
) -> int:
    """Memory one block takes across all layers, keys and values (an int8 row holds its scale
    too; ``values=False``: the key rows hold the values, MLA's)."""
    return block_size * kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, values)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory of {budget_bytes} bytes holds no block; one block needs {block_bytes} bytes"
        )
    return num_blocks


_ALIGN = 64  # bytes: one cache line / one AVX-512 vector


def _zeroed_cpu_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages are only touched when first written.

    ``numpy.zeros`` uses ``calloc``, which for large sizes maps fresh (already zero) pages
    instead of writing zeros, so a 1 GiB KV budget costs neither start-up time (~2 s to zero)
    nor resident memory until blocks are used. The bytes are reinterpreted as ``dtype``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    np_dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    # calloc returns page start + 16 bytes: over-allocate and start on a 64-byte boundary,
    # or every 128-byte K/V row straddles three cache lines instead of two.
    pad = _ALIGN // itemsize
    raw = torch.from_numpy(np.zeros(numel + pad, dtype=np_dtype)).view(dtype)
    skip = (-raw.data_ptr() % _ALIGN) // itemsize
    return raw[skip : skip + numel]


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    values: bool = True,
) -> KVCache:
    """Zero-filled, so slots never written hold no NaNs that masked attention could touch
    (an int8 row's zero scale reads back as zeros). Rows are ``kv_row_width`` wide. With
    ``values=False`` (MLA: the key rows hold the values) a layer's pair is one tensor twice.

    On CPU all layers' K and V live in one lazily zeroed buffer (see ``_zeroed_cpu_buffer``).
    """
    shape = (num_blocks, block_size, num_kv_heads, kv_row_width(head_dim, dtype))
    tensors = 2 if values else 1
    if device.type != "cpu":
        views = torch.zeros((num_layers, tensors, *shape), dtype=dtype, device=device)
    else:
        per_tensor = num_blocks * block_size * num_kv_heads * shape[-1]
        views = _zeroed_cpu_buffer(tensors * num_layers * per_tensor, dtype).view(num_layers, tensors, *shape)
    pairs = []
    for layer in views:
        key_cache = layer[0]
        pairs.append((key_cache, layer[1] if values else key_cache))
    return pairs


def distinct_kv(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A layer's cache tensors, each once (MLA's pair is one tensor twice)."""
    key_cache, value_cache = pair
    return (key_cache,) if key_cache.data_ptr() == value_cache.data_ptr() else pair


def copy_blocks(kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer (copy-on-write), one indexed copy per tensor."""
    if not copies:
        return
    # (not a recurrent layer's block snapshots: only a full block has one, and a copied block is
    # one being written, so never full)
    pairs = [pair for pair in kv_cache if isinstance(pair, tuple)]
    device = pairs[0][0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=device)
    for pair in pairs:
        for cache in map(indexable, distinct_kv(pair)):
            cache.index_copy_(0, dst, cache.index_select(0, src))


def copy_states(caches: KVCache, copies: list[tuple[int, int]]) -> None:
    """Copy recurrent-state slots src -> dst in every recurrent layer (all read before any is written)."""
    pairs = [(t, t) for state in _states(caches, copies) for t in state.slot_tensors()]
    _copy_rows(pairs, copies)


def load_states(caches: KVCache, loads: list[tuple[int, int]]) -> None:
    """Start state slots from the prefix cache's snapshots, (source, slot) pairs, in every
    recurrent layer (a request whose first blocks came from the cache): a short convolution's
    from the KV block ``source`` (a snapshot each block), a scan layer's from its snapshot row
    ``source`` (rows after the slots: ``core/state_snapshots.py``)."""
    states = _states(caches, loads)
    if loads and len({type(state) for state in states}) > 1:
        raise ValueError("a model with both short convolutions and scan layers keeps no state snapshots")
    _copy_rows([pair for state in states for pair in _snapshot_pairs(state)], loads)


def _snapshot_pairs(state: ConvState | ScanState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(where a layer's snapshots are, its slots) for each of its state tensors."""
    if isinstance(state, ConvState):
        return [(state.blocks, state.slots)]
    return [(tensor, tensor) for tensor in state.slot_tensors()]


def scan_snapshot_rows(arch: ModelArchConfig, rows: int) -> int:
    """The snapshot rows a model keeps after its state slots: ``rows`` (``EngineConfig.
    state_snapshot_rows``) for a model with scan layers, none for one whose states a KV block
    keeps (short convolutions only, or no recurrent layer); none, too, for a model with both
    kinds (no family has them: its cache is off)."""
    scans = sum(arch.scan_shape(layer) is not None for layer in arch.recurrent_layers)
    return rows if scans == len(arch.recurrent_layers) and scans else 0


def checkpoint_rows_from(arch: ModelArchConfig, config: EngineConfig) -> int | None:
    """Where the state slots' checkpoint rows start, one a slot after the slots and the snapshot
    rows (``core/state_slots.py``); None without speculative decoding (none kept)."""
    if config.speculative is None or not arch.recurrent_layers:
        return None
    return config.scheduler.max_num_seqs + scan_snapshot_rows(arch, config.state_snapshot_rows)


def _states(caches: KVCache, pairs: list[tuple[int, int]]) -> list[ConvState | ScanState]:
    """The recurrent layers' states (an error where pairs are asked of a model without any)."""
    states = [cache for cache in caches if isinstance(cache, (ConvState, ScanState))]
    if pairs and not states:
        raise ValueError("state copies for a model without recurrent layers")
    return states


# Up to this many pairs, none of whose rows is both read and written, are copied a row at a time:
# one pass over the bytes instead of a gathered copy and a scatter (a speculating sequence's
# checkpoint of a Qwen3.5-0.8B-shaped state, 18.6 MiB: 2.2 -> 1.0 ms on a 2-core Zen 4).
_ROW_BY_ROW_PAIRS = 4


def _copy_rows(tensors: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """target[pair[1]] = source[pair[0]] for each pair, in each (source, target) of ``tensors``,
    every source row read before any target row is written."""
    if not pairs or not tensors:
        return
    if len(pairs) <= _ROW_BY_ROW_PAIRS and not {d for _, d in pairs} & {s for s, _ in pairs}:
        for source, target in tensors:
            for s, d in pairs:
                target[d].copy_(source[s])
        return
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=tensors[0][0].device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=tensors[0][0].device)
    for source, target in tensors:
        target.index_copy_(0, dst, source.index_select(0, src))


def with_recurrent_states(
    arch: ModelArchConfig, attention: KVCache, num_slots: int, num_blocks: int, dtype: torch.dtype,
    device: torch.device, num_snapshots: int = 0, num_checkpoints: int = 0, layers: range | None = None,
) -> KVCache:
    """Every layer's cache in layer order: ``attention``'s K/V pairs (one an attention layer, in
    order) and, for each recurrent layer, its zeroed states: a short convolution's last
    ``conv_kernel - 1`` inputs for each state slot and each KV block (``model/short_conv.py``;
    ``arch``: this rank's share, whose channels they are), a scan layer's convolution inputs and
    float32 matrix state for each state slot and then each of its ``num_snapshots`` snapshot
    rows (``model/scan_state.py``, ``core/state_snapshots.py``); then ``num_checkpoints`` rows
    (``checkpoint_rows_from``; a short convolution's slots have no snapshot rows before them:
    a model with short convolutions keeps none). ``layers``: a pipeline stage's (default: all)."""
    layers = range(arch.num_hidden_layers) if layers is None else layers
    recurrent = set(arch.recurrent_layers).intersection(layers)
    if not recurrent:
        return attention
    pairs = iter(attention)

    def zeros(shape: tuple[int, ...], of: torch.dtype) -> torch.Tensor:
        if device.type == "cpu":  # (pages of rows never written stay untouched: a block's snapshot, a slot)
            return _zeroed_cpu_buffer(math.prod(shape), of).view(shape)
        return torch.zeros(shape, dtype=of, device=device)

    def states(layer: int) -> ConvState | ScanState:
        shape = arch.scan_shape(layer)
        if shape is not None:
            conv, ssm = shape.state_shapes()
            rows = num_slots + num_snapshots + num_checkpoints
            return ScanState(zeros((rows, *conv), dtype), zeros((rows, *ssm), torch.float32))
        row = (arch.conv_kernel - 1, arch.convolution_channels)
        return ConvState(zeros((num_slots + num_checkpoints, *row), dtype), zeros((num_blocks, *row), dtype))

    return [states(i) if i in recurrent else next(pairs) for i in layers]


def attention_layers_in(arch: ModelArchConfig, layers: range) -> int:
    """How many of ``layers`` keep K/V in the pool (not a recurrent layer)."""
    return len(set(layers).difference(arch.recurrent_layers))


def state_slot_bytes(arch: ModelArchConfig, num_slots: int, dtype: torch.dtype, layers: range | None = None) -> int:
    """The memory of ``num_slots`` state slots of every recurrent layer (of ``layers``: a
    pipeline stage's; a scan's matrix state float32)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_slot = 0
    for shape in filter(None, map(arch.scan_shape, _recurrent_in(arch, layers))):
        conv, ssm = shape.state_shapes()
        per_slot += math.prod(conv) * itemsize + math.prod(ssm) * 4
    return num_slots * (per_slot + state_snapshot_bytes(arch, dtype, layers))  # (a convolution's slot: a snapshot's)


def state_snapshot_bytes(arch: ModelArchConfig, dtype: torch.dtype, layers: range | None = None) -> int:
    """The memory one KV block's snapshots of the recurrent layers' states take (of ``layers``;
    a short convolution's inputs; a scan layer keeps none)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    convolutions = sum(arch.scan_shape(layer) is None for layer in _recurrent_in(arch, layers))
    return convolutions * (arch.conv_kernel - 1) * arch.convolution_channels * itemsize


def _recurrent_in(arch: ModelArchConfig, layers: range | None) -> list[int]:
    return [i for i in arch.recurrent_layers if layers is None or i in layers]
