"""KV memory: paged blocks (our real ``KVCacheManager``) against contiguous reservation, no model.

Both allocators get the same KV budget (``kv_cache_tokens`` token slots) and serve the same
request lengths (by default the ``mixed`` workload's: prompt length P, output length O =
``max_tokens``) under the same first-come-first-served continuous batching loop:

* a request is admitted when the allocator can hold its prompt; that step computes its P
  prompt tokens (and samples its first output token);
* every later step computes one more token per running request, so after k decode steps it
  holds P + k tokens; it finishes after O - 1 decode steps, holding P + O - 1 tokens, and
  frees its memory at the end of that step;
* before admitting, running requests grow (oldest first); when the pool cannot grow one, the
  newest running request is preempted (memory freed, recomputed later from the front of the
  queue) and nothing is admitted in that step, as the engine's scheduler does. (Contiguous
  reservations never need to grow.)

Allocators:

* ``paged``: ``KVCacheManager(num_blocks = kv_cache_tokens // block_size, block_size)``: a
  request holds ceil(tokens / block_size) blocks, taken one at a time as it grows.
* ``naive``: contiguous first-fit regions in one arena of ``kv_cache_tokens`` slots; each
  admitted request reserves ``max_model_len`` slots up front (what a server without paging
  must do when it does not know the output length; Orca-"Max" in the vLLM paper).
* ``naive-oracle`` (optional, ``--naive-oracle``): reserves exactly P + O - 1 slots up front,
  contiguous (it knows each output length in advance): its waste is the slots reserved for
  tokens not generated yet, and holes between variable-size regions limit admissions.

Measured at the end of every step: requests held, tokens stored, slots reserved. Reported:
the largest number of requests held at once, the mean over steps, the fraction of reserved
slots that hold no token (time-averaged: sum of empty reserved slots over steps / sum of
reserved slots over steps; and at the step of peak reservation), reserved slots per request,
number of steps and preemptions.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from pagellm.benchmarks._common import format_table, machine_info
from pagellm.benchmarks.workloads import make_workload


class Allocator(Protocol):
    name: str

    def grow(self, req_id: int, held: int, new: int) -> bool: ...  # room for `new` more tokens

    def free(self, req_id: int) -> None: ...

    def reserved(self) -> int: ...  # token slots reserved by live requests


class PagedAllocator:
    """Our block allocator (``pagellm.core.KVCacheManager``), driven with real ``Sequence`` objects."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        from pagellm.core.kv_cache_manager import KVCacheManager

        kwargs: dict[str, Any] = {}
        if "enable_caching" in inspect.signature(KVCacheManager.__init__).parameters:
            kwargs["enable_caching"] = False
        self.manager = KVCacheManager(num_blocks, block_size, **kwargs)
        self.block_size = block_size
        self._requests: dict[int, Any] = {}

    def _request(self, req_id: int, held: int) -> Any:
        from pagellm.core.sequence import Sequence
        from pagellm.sampling_params import SamplingParams

        request = self._requests.get(req_id)
        if request is None:
            request = Sequence(
                seq_id=str(req_id), prompt_token_ids=[0], sampling_params=SamplingParams(), max_tokens=1
            )
            self._requests[req_id] = request
        request.num_computed_tokens = held
        return request

    def grow(self, req_id: int, held: int, new: int) -> bool:
        return self.manager.allocate_slots(self._request(req_id, held), new)

    def free(self, req_id: int) -> None:
        request = self._requests.pop(req_id, None)
        if request is not None:
            self.manager.free(request)

    def reserved(self) -> int:
        return (self.manager.num_blocks - self.manager.num_free_blocks) * self.block_size


class ContiguousAllocator:
    """First-fit contiguous regions in a ``capacity``-slot arena; a region never grows.

    ``reserve(prompt_len, total_len)`` says how many slots a request reserves when admitted.
    """

    def __init__(self, name: str, capacity: int, reserve) -> None:
        self.name = name
        self.capacity = capacity
        self.reserve = reserve
        self.regions: dict[int, tuple[int, int]] = {}  # req -> (start, size)
        self.sizes: dict[int, int] = {}  # req -> slots it will ever need (set by the simulator)

    def _first_fit(self, size: int) -> int | None:
        start = 0
        for s, n in sorted(self.regions.values()):
            if s - start >= size:
                return start
            start = max(start, s + n)
        return start if self.capacity - start >= size else None

    def grow(self, req_id: int, held: int, new: int) -> bool:
        if req_id in self.regions:
            start, size = self.regions[req_id]
            return held + new <= size
        size = self.reserve(self.sizes[req_id])
        if held + new > size:
            return False
        start = self._first_fit(size)
        if start is None:
            return False
        self.regions[req_id] = (start, size)
        return True

    def free(self, req_id: int) -> None:
        self.regions.pop(req_id, None)

    def reserved(self) -> int:
        return sum(n for _, n in self.regions.values())


@dataclass
class SimResult:
    allocator: str
    max_requests_held: int
    mean_requests_held: float
    waste_fraction: float  # time-averaged share of reserved slots holding no token
    waste_at_peak: float  # same, at the step with the most reserved slots
    mean_reserved_per_request: float  # token slots reserved per running request (time-averaged)
    mean_tokens_per_request: float
    steps: int
    preemptions: int
    finished: int
    timeline: dict[str, list[int]] = field(default_factory=dict)  # per step: held, tokens, reserved


def simulate(
    allocator: Allocator,
    lengths: list[tuple[int, int]],
    max_num_seqs: int | None = None,
    keep_timeline: bool = False,
) -> SimResult:
    """Run the continuous-batching loop in the module doc over ``(prompt_len, output_len)`` pairs."""
    if hasattr(allocator, "sizes"):
        allocator.sizes.update({i: p + o - 1 for i, (p, o) in enumerate(lengths)})  # type: ignore[attr-defined]
    waiting: deque[int] = deque(range(len(lengths)))
    running: list[int] = []  # admission order, oldest first
    held: dict[int, int] = {}  # tokens in the cache
    sampled: dict[int, int] = {}  # output tokens sampled so far
    steps = preemptions = finished = 0
    sum_held = sum_tokens = sum_reserved = 0
    peak_reserved, waste_at_peak, max_held = 0, 0.0, 0
    timeline: dict[str, list[int]] = {"held": [], "tokens": [], "reserved": []}

    while waiting or running:
        # 1. running requests compute their last sampled token (one slot each), oldest first.
        preempted = False
        i = 0
        while i < len(running):
            req = running[i]
            if allocator.grow(req, held[req], 1):
                held[req] += 1
                i += 1
                continue
            victim = running.pop()  # newest
            allocator.free(victim)
            held.pop(victim)
            sampled.pop(victim)
            waiting.appendleft(victim)
            preemptions += 1
            preempted = True
            # if the victim was `req` itself the loop ends (i == len(running))
        # 2. admit waiting requests (their whole prompt, or everything recomputed) while they fit;
        #    not in a step that preempted (the scheduler's rule: it would only preempt again).
        while not preempted and waiting and (max_num_seqs is None or len(running) < max_num_seqs):
            req = waiting[0]
            prompt_len = lengths[req][0]
            if not allocator.grow(req, 0, prompt_len):
                break
            waiting.popleft()
            running.append(req)
            held[req] = prompt_len
            sampled[req] = 0
        if not running:
            p, o = lengths[waiting[0]]
            raise ValueError(f"request of prompt {p} + output {o} tokens never fits the KV budget")
        for req in running:
            sampled[req] += 1
        steps += 1
        reserved = allocator.reserved()
        tokens = sum(held.values())
        sum_held += len(running)
        sum_tokens += tokens
        sum_reserved += reserved
        max_held = max(max_held, len(running))
        if reserved > peak_reserved:
            peak_reserved, waste_at_peak = reserved, 1 - tokens / reserved
        if keep_timeline:
            timeline["held"].append(len(running))
            timeline["tokens"].append(tokens)
            timeline["reserved"].append(reserved)
        # 3. requests that sampled their last token finish and free their memory.
        done = [req for req in running if sampled[req] >= lengths[req][1]]
        for req in done:
            running.remove(req)
            allocator.free(req)
            held.pop(req)
            sampled.pop(req)
            finished += 1

    return SimResult(
        allocator=allocator.name,
        max_requests_held=max_held,
        mean_requests_held=sum_held / steps,
        waste_fraction=1 - sum_tokens / sum_reserved if sum_reserved else 0.0,
        waste_at_peak=waste_at_peak,
        mean_reserved_per_request=sum_reserved / sum_held,
        mean_tokens_per_request=sum_tokens / sum_held,
        steps=steps,
        preemptions=preemptions,
        finished=finished,
        timeline=timeline if keep_timeline else {},
    )


@dataclass
class MemoryConfig:
    workload: str = "mixed"
    num_prompts: int | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_tokens: int = 16384
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    naive_oracle: bool = False
    bytes_per_token: int | None = None  # for MiB columns; None: from the default model's shape if readable
    model: str | None = None
    keep_timeline: bool = False


def _bytes_per_token(cfg: MemoryConfig, dtype_bytes: int = 2) -> int | None:
    if cfg.bytes_per_token is not None:
        return cfg.bytes_per_token
    try:
        from pagellm.model.loader import load_arch_config

        arch = load_arch_config(cfg.model)
    except Exception:  # no model installed: report in token slots only
        return None
    return 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * dtype_bytes


def run_memory(cfg: MemoryConfig) -> dict[str, Any]:
    # Lengths do not depend on the vocabulary; any size works for drawing them.
    workload = make_workload(cfg.workload, 32000, num_prompts=cfg.num_prompts, seed=cfg.seed)
    lengths = [(r.prompt_len, r.max_tokens) for r in workload.requests]
    too_long = [p + o - 1 for p, o in lengths if p + o - 1 > cfg.max_model_len]
    if too_long:
        raise ValueError(f"{len(too_long)} requests need more than max_model_len={cfg.max_model_len} slots")
    if cfg.kv_cache_tokens < cfg.max_model_len:
        raise ValueError("kv_cache_tokens must hold at least one max_model_len request")
    allocators: list[Allocator] = [
        PagedAllocator(cfg.kv_cache_tokens // cfg.block_size, cfg.block_size),
        ContiguousAllocator("naive", cfg.kv_cache_tokens, lambda need: cfg.max_model_len),
    ]
    if cfg.naive_oracle:
        allocators.append(ContiguousAllocator("naive-oracle", cfg.kv_cache_tokens, lambda need: need))
    results = [simulate(a, lengths, cfg.max_num_seqs, cfg.keep_timeline) for a in allocators]
    bpt = _bytes_per_token(cfg)
    rows = []
    for r in results:
        row = asdict(r)
        if bpt is not None:
            row["mean_reserved_mib_per_request"] = r.mean_reserved_per_request * bpt / 2**20
        rows.append(row)
    paged = rows[0]
    for row in rows[1:]:
        row["paged_x_requests"] = paged["max_requests_held"] / max(1, row["max_requests_held"])
    return dict(
        benchmark="memory",
        workload=workload.describe(),
        config=asdict(cfg),
        bytes_per_token=bpt,
        kv_budget_mib=cfg.kv_cache_tokens * bpt / 2**20 if bpt else None,
        machine=machine_info(),
        results=rows,
    )


TABLE_COLUMNS = [
    ("allocator", "allocator", ""),
    ("max_requests_held", "max reqs held", "d"),
    ("mean_requests_held", "mean reqs held", ".1f"),
    ("waste_fraction", "waste (time avg)", ".1%"),
    ("waste_at_peak", "waste at peak", ".1%"),
    ("mean_reserved_per_request", "slots/req", ".0f"),
    ("mean_reserved_mib_per_request", "MiB/req", ".2f"),
    ("steps", "steps", "d"),
    ("preemptions", "preempt", "d"),
]


def format_report(report: dict[str, Any]) -> str:
    cfg, w = report["config"], report["workload"]
    budget = f"{cfg['kv_cache_tokens']} token slots"
    if report.get("kv_budget_mib"):
        budget += f" ({report['kv_budget_mib']:.0f} MiB at {report['bytes_per_token']} bytes/token)"
    lines = [
        f"workload {w['name']}: {w['num_requests']} requests, prompt mean {w['prompt_len_mean']:.0f} "
        f"(max {w['prompt_len_max']}), output mean {w['max_tokens_mean']:.0f} (max {w['max_tokens_max']})",
        f"KV budget {budget}; block_size {cfg['block_size']}; naive reserves max_model_len={cfg['max_model_len']}",
        format_table(report["results"], TABLE_COLUMNS),
    ]
    for row in report["results"][1:]:
        lines.append(f"  paged holds {row['paged_x_requests']:.1f}x the requests of {row['allocator']} at peak")
    return "\n".join(lines)
