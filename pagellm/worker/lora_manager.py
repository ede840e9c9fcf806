"""The worker's LoRA adapters: which are loaded in host memory (least recently used evicted past
``max_cpu_loras``), which sit in the ``max_loras`` slots a step reads (``model/lora.py``), and
each step's rows grouped by slot.

The scheduler never runs more adapters in one step than there are slots (``core/scheduler.py``),
so every adapter of a step finds one: a free slot, else the one used longest ago by an adapter
not in this step. Loading depends only on the steps, so tensor-parallel ranks would agree.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pagellm.lora_config import LoRAConfig
from pagellm.lora_request import LoRARequest
from pagellm.model.arch_config import ModelArchConfig
from pagellm.model.layer_spec import layer_specs
from pagellm.model.lora import LoRASlots, LoRAStep, PreparedAdapter, Rows
from pagellm.distributed.tensor_parallel import TensorParallel
from pagellm.kernels.arg_checks import DTYPE_CODES
from pagellm.kernels.library import KernelLibrary
from pagellm.model.lora_adapter import LoRAAdapterError, rank_share, read_adapter

logger = logging.getLogger(__name__)

NO_LORA = 0  # a row's adapter id when it runs the base model


class LoRAManager:
    """See the module docstring; ``register`` each adapter as its sequences arrive, then call
    ``step`` with the step's rows."""

    def __init__(
        self, config: LoRAConfig, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
        tp: TensorParallel | None = None, kernels: KernelLibrary | None = None,
    ) -> None:
        """``arch``: the whole model (adapters are checked against it); ``tp``: this rank's share
        of each layer, and of each adapter; ``kernels``: the CPU kernel library (None: torch)."""
        self.config = config
        self.arch = arch
        self.device = device
        self.tp = tp
        specs = layer_specs(arch.shard(tp.size) if tp is not None else arch)
        # On CPU pagellm's LoRA kernel runs the products (``kernels``, float32 or bf16 models on
        # AVX2 builds), else torch in float32 (its bf16 products of these shapes are slow).
        if kernels is not None and not (kernels.gemm_avx2_available and dtype in DTYPE_CODES):
            kernels = None
        if kernels is None and device.type == "cpu":
            dtype = torch.float32
        self.slots = LoRASlots(specs, config.max_loras, config.max_lora_rank, dtype, device, kernels)
        self.requests: dict[int, LoRARequest] = {}  # adapter id -> where it is (every id a row may name)
        self.loaded: OrderedDict[int, PreparedAdapter] = OrderedDict()  # host memory, least recently used first
        self.slot_of: dict[int, int] = {}  # adapter id -> slot
        self.in_slot: list[int] = [NO_LORA] * config.max_loras
        self.last_used = [0] * config.max_loras  # the step each slot last served
        self._step = 0
        # Adapters read ahead (``prefetch``) in one background thread, until a step takes them.
        self._reader: ThreadPoolExecutor | None = None
        self._reading: dict[int, Future[PreparedAdapter]] = {}
        self.prefetched = 0  # adapters whose reading a prefetch started
        logger.info("LoRA: %d slots of rank %d (%.1f MiB), products on %s", config.max_loras, config.max_lora_rank,
                    self.slots.num_bytes() / 2**20, "pagellm's LoRA kernel" if kernels is not None else "torch")  # fmt: skip

    def register(self, request: LoRARequest) -> None:
        """An adapter rows will name by its id (a new sequence's); a changed path reloads it."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self._evict(request.lora_int_id)
        self.requests[request.lora_int_id] = request

    def prefetch(self, requests: list[LoRARequest]) -> None:
        """Start reading the adapters of requests waiting for a slot (``SchedulerOutput.
        lora_prefetch``) in a background thread, no more at once than host memory keeps: the
        step that first runs one then takes it from memory instead of its files."""
        self._collect()
        for request in requests:
            self.register(request)
            lora_id = request.lora_int_id
            if lora_id in self.loaded or lora_id in self.slot_of or lora_id in self._reading:
                continue
            if len(self._reading) >= self.config.cpu_loras:
                break
            if self._reader is None:
                self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-prefetch")
            self._reading[lora_id] = self._reader.submit(self._read, request)
            self.prefetched += 1

    def _collect(self) -> None:
        """Adapters read ahead and done join host memory (least recently used evicted past
        ``max_cpu_loras``); a read that failed is dropped (the step that needs the adapter reads
        it again, and its error fails the requests then)."""
        for lora_id in [i for i, reading in self._reading.items() if reading.done()]:
            reading = self._reading.pop(lora_id)
            if reading.exception() is None:
                self._keep(lora_id, reading.result())

    def _keep(self, lora_id: int, adapter: PreparedAdapter) -> None:
        self.loaded[lora_id] = adapter
        self.loaded.move_to_end(lora_id)
        while len(self.loaded) > self.config.cpu_loras:
            self.loaded.popitem(last=False)

    def forget(self, live_ids: set[int]) -> None:
        """Drop the paths of adapters no row names any more (those loaded or being read stay)."""
        for lora_id in [i for i in self.requests if i not in live_ids and i not in self.loaded and i not in self._reading]:
            del self.requests[lora_id]

    def step(self, row_ids: np.ndarray, query_lens: np.ndarray) -> tuple[LoRAStep | None, dict[int, str]]:
        """The step's adapters put in slots and its token rows grouped by slot (None: no row
        runs with one), and the adapters that could not be loaded (id -> why; their rows run
        the base model and the engine fails their requests alone)."""
        self._collect()
        self._step += 1
        ids = [int(i) for i in np.unique(row_ids) if i != NO_LORA]
        loading = [lora_id for lora_id in ids if lora_id not in self.slot_of]  # (alike on every rank)
        failed: dict[int, str] = {}
        for lora_id in ids:
            try:
                self._make_resident(lora_id, ids)
            except (LoRAAdapterError, OSError, RuntimeError, MemoryError) as exc:
                failed[lora_id] = str(exc)
        if loading and self.tp is not None:
            self._agree(loading, failed)
        if len(failed) == len(ids):
            return None, failed
        slot_of = [self.slot_of.get(int(i), -1) if int(i) not in failed else -1 for i in row_ids]
        token_slots = np.repeat(np.array(slot_of, dtype=np.int64), query_lens)
        groups: list[tuple[int, Rows]] = []
        for slot in np.unique(token_slots):
            if slot < 0:
                continue
            rows = np.flatnonzero(token_slots == slot)
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            where: Rows = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else torch.from_numpy(rows).to(self.device)
            groups.append((int(slot), where))
        return (LoRAStep(self.slots, groups) if groups else None), failed

    def _agree(self, loading: list[int], failed: dict[int, str]) -> None:
        """Tensor-parallel ranks agree on which of the adapters this step loaded failed: one that
        failed on any rank fails on all (a rank's share alone would sum to garbage)."""
        assert self.tp is not None
        flags = torch.tensor([float(lora_id in failed) for lora_id in loading], dtype=torch.float32)
        self.tp.all_reduce_(flags)
        for lora_id, flag in zip(loading, flags.tolist()):
            if flag and lora_id not in failed:
                failed[lora_id] = "it could not be loaded on another tensor-parallel rank (that rank's log says why)"
                self._evict(lora_id)

    def _evict(self, lora_id: int) -> None:
        """Take ``lora_id`` out of its slot (and host memory)."""
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slots.clear(slot)
            self.in_slot[slot] = NO_LORA
        self.loaded.pop(lora_id, None)
        self._reading.pop(lora_id, None)  # (a read under way finishes unused)

    def _make_resident(self, lora_id: int, step_ids: list[int]) -> None:
        """``lora_id``'s adapter in a slot (loaded from its files first where it is not in host memory)."""
        slot = self.slot_of.get(lora_id)
        if slot is None:
            adapter = self._adapter(lora_id)
            busy = {self.slot_of[i] for i in step_ids if i in self.slot_of}
            free = [s for s in range(self.config.max_loras) if s not in busy]
            if not free:  # (the scheduler never sends more adapters than slots)
                raise LoRAAdapterError(f"no LoRA slot is free for adapter {lora_id}: this step holds more adapters "
                                       f"than --max-loras {self.config.max_loras}")  # fmt: skip
            slot = min(free, key=lambda s: self.last_used[s])
            old = self.in_slot[slot]
            if old != NO_LORA:
                del self.slot_of[old]
                self.in_slot[slot] = NO_LORA
            self.slots.load(slot, adapter)  # (a load that fails leaves the slot empty, and free)
            self.in_slot[slot], self.slot_of[lora_id] = lora_id, slot
        self.last_used[slot] = self._step
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)

    def _adapter(self, lora_id: int) -> PreparedAdapter:
        """The adapter as a slot takes it, from host memory (read ahead, or kept), or read from
        its files and prepared (evicting the least recently used): a slot switch then only copies."""
        adapter = self.loaded.get(lora_id)
        if adapter is not None:
            return adapter
        reading = self._reading.pop(lora_id, None)
        if reading is not None:
            adapter = reading.result()  # (waits for a read under way; raises what it raised)
        else:
            request = self.requests.get(lora_id)
            if request is None:
                raise LoRAAdapterError(f"adapter id {lora_id} was never registered with the worker")
            adapter = self._read(request)
        self._keep(lora_id, adapter)
        return adapter

    def _read(self, request: LoRARequest) -> PreparedAdapter:
        """The adapter from its files, this rank's share, as a slot takes it (touches nothing the
        steps use: it may run in the prefetch thread)."""
        start = time.perf_counter()
        weights = read_adapter(request.lora_path, self.arch, self.config.max_lora_rank)
        if self.tp is not None:
            weights = rank_share(weights, self.tp)
        adapter = self.slots.prepare(weights)
        logger.info("LoRA adapter %r (rank %d) read in %.0f ms", request.lora_name, adapter.info.rank,
                    (time.perf_counter() - start) * 1e3)  # fmt: skip
        return adapter
