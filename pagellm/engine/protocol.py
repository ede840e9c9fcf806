"""The engine boundary: a request as the engine takes it (``EngineRequest``), the interface of
every engine a caller drives (``EngineClient``), where request metrics go, and the errors that
end requests.

``KVSnapshot`` (what ``snapshot`` returns) is re-exported here for the entry points, which name
nothing below the engine; ``EngineStats`` (what ``stats`` returns) lives here, below every engine
that fills it, so that the boundary imports no engine.

Kept apart from ``async_engine`` so entry points and tests can name these without the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pagellm.core.kv_snapshot import KVSnapshot, SequenceView  # noqa: F401 -- re-exported
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.lora_request import LoRARequest
from pagellm.multimodal_inputs import ImageFeature
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pagellm.engine.input_processor import InputProcessor


class EngineDeadError(RuntimeError):
    """The step loop is not running: it crashed, is restarting the engine, or the server is shutting down."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are admitted and unfinished; the client should retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (the others go on); details are in the server log."""


class RequestRejectedError(ValueError):
    """The engine could not serve this one request as asked (its own fault: a client error)."""


@dataclass
class EngineRequest:
    """One tokenized request at the engine boundary, as every ``EngineClient`` takes it (and as
    it crosses to an engine process); per-request extras (a grammar, say) become fields here."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams | PoolingParams  # PoolingParams: an embedding
    prompt: str | None = None
    cache_salt: str | None = None  # isolates its prefix-cache entries (per tenant)
    stream: bool = True  # deltas; False: one whole output at the end (what best_of needs)
    # time.monotonic() when the request arrived (one clock for every process of a machine); the
    # scheduler serves in this order. None: when the engine takes it.
    arrival_time: float | None = None
    # The sender already checked ``params`` against this engine's limits (the server does, at its
    # boundary, to answer 400s naming the field): the engine does not check them (nor validate a
    # grammar) a second time.
    params_checked: bool = False
    # The engine's --scheduling-policy priority serves lower values first (vLLM's); 0 otherwise.
    priority: int = 0
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (None: the base model)
    mm_features: tuple[ImageFeature, ...] = ()  # its images (``multimodal_inputs.py``)


@dataclass
class EngineStats:
    """Counters for logs and metrics (cumulative unless said otherwise)."""

    num_steps: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0  # computed prompt tokens, recompute included
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused
    num_cow_copies: int = 0  # blocks copied on write
    num_shared_blocks: int = 0  # gauge: blocks held by more than one sequence
    peak_blocks_in_use: int = 0  # most KV blocks held at once
    num_running: int = 0  # gauge
    num_waiting: int = 0  # gauge
    kv_cache_usage: float = 0.0  # gauge: fraction of blocks in use
    # Speculative decoding: sequence-steps that verified drafts, tokens proposed, tokens accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Images in the requests taken, and those the vision encoder ran on (the rest: its cache's).
    num_images: int = 0
    num_images_encoded: int = 0
    # The disk tier under the prefix cache (all 0: none): its size and fill (gauges, bytes), the
    # blocks looked up past the pool's hits and found, loaded, entries refused when read, blocks
    # sent to be written and writes refused; the bytes and seconds of its reads and writes.
    disk_tier_capacity_bytes: int = 0
    disk_tier_used_bytes: int = 0
    disk_tier_queries: int = 0
    disk_tier_hits: int = 0
    disk_tier_loaded_blocks: int = 0
    disk_tier_load_failures: int = 0
    disk_tier_stored_blocks: int = 0
    disk_tier_write_failures: int = 0
    disk_tier_bytes_read: int = 0
    disk_tier_read_seconds: float = 0.0
    disk_tier_bytes_written: int = 0
    disk_tier_write_seconds: float = 0.0
    # Steps per route (StepRoute.describe(): fused stack or layers, linears' GEMM, attention).
    step_routes: dict[str, int] = field(default_factory=dict)
    # LoRA (gauges): adapters the engine holds at once (0: LoRA off), and the sequences running
    # and waiting with each adapter, by name.
    max_loras: int = 0
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)


class EngineClient(Protocol):
    """What drives an engine: ``LLMEngine`` in process, ``EngineProcess`` in a child process
    (one round trip per call, so every call takes a batch), ``DataParallelEngine`` over several
    of those, and the tests' fakes. The properties are everything the front end reads of an
    engine, so it needs no ``getattr`` on any of them."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (the front end renders chat templates and counts tokens)."""

    @property
    def input_processor(self) -> InputProcessor:
        """The request checks, run by the front end before a request reaches the engine."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def kernel_plan_info(self) -> dict[str, str]:
        """``KernelPlan.as_dict()``: what runs where (``/version``)."""

    @property
    def stats(self) -> EngineStats:
        """The counters of the whole engine (all replicas summed)."""

    @property
    def replica_stats(self) -> list[EngineStats]:
        """Each replica's counters (one engine: its own, alone)."""

    @property
    def num_replicas(self) -> int:
        """Engine replicas (data parallelism), each with its own KV pool and queues; 1 without."""

    def add_requests(self, requests: list[EngineRequest]) -> list[ValueError | None]:
        """Queue the requests in order; one refused for its input gets its ``ValueError`` in
        its place (the others are queued). Any other exception means the engine failed."""

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def check_health(self) -> None:
        """Raise if the engine can no longer serve (a dead engine process)."""

    def snapshot(self, max_requests: int, replica: int = 0) -> KVSnapshot:
        """A bounded, read-only picture of one replica's queues and KV pool, taken between
        steps (one engine: replica 0 only; ValueError for another)."""

    def restart(self) -> bool:
        """Start a fresh engine in place of a dead one; False if this engine cannot."""


class RequestMetrics(Protocol):
    """Where per-request latencies go (``pagellm.metrics.prometheus.PrometheusMetrics``)."""

    def observe_time_to_first_token(self, seconds: float) -> None: ...

    def observe_time_per_output_token(self, seconds: float) -> None: ...

    def observe_e2e_latency(self, seconds: float) -> None: ...

    def count_finished(self, finish_reason: str) -> None: ...

    def count_rejected(self, reason: str) -> None: ...

    def count_engine_restart(self) -> None: ...
