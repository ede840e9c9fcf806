"""Prometheus metrics for the server, named like vLLM's (``pagellm:`` instead of ``vllm:``).

Gauges and cumulative counters are read from the engine's stats object at scrape time, so
the engine never pushes them; per-request latencies (TTFT, time per output token, end to
end) and finish reasons are observed by the async engine as requests progress. Each
instance owns its registry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagellm.metrics.histogram import HistogramCounts

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0)


class EngineStatsView(Protocol):
    """What the metrics read from the engine (``pagellm.engine.protocol.EngineStats``)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_prompt_tokens: int
    num_generated_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_shared_blocks: int
    num_cow_copies: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    num_images: int
    num_images_encoded: int
    disk_tier_capacity_bytes: int
    disk_tier_used_bytes: int
    disk_tier_queries: int
    disk_tier_hits: int
    disk_tier_loaded_blocks: int
    disk_tier_load_failures: int
    disk_tier_stored_blocks: int
    disk_tier_write_failures: int
    disk_tier_bytes_read: int
    disk_tier_read_seconds: float
    disk_tier_bytes_written: int
    disk_tier_write_seconds: float
    max_loras: int
    lora_running: dict[str, int]
    lora_waiting: dict[str, int]


class _EngineStatsCollector(Collector):
    """Reads the engine's gauges and counters when Prometheus scrapes, never in between. With
    data-parallel replicas, each series is per replica (label ``engine``, as vLLM labels them)."""

    def __init__(
        self, model_name: str, stats: Callable[[], EngineStatsView],
        replica_stats: Callable[[], list[EngineStatsView]] | None = None,
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._replica_stats = replica_stats

    def collect(self) -> Iterator[Metric]:
        if self._replica_stats is None:
            series = [([self._model_name], self._stats())]
            labels = ["model_name"]
        else:
            series = [([self._model_name, str(i)], s) for i, s in enumerate(self._replica_stats())]
            labels = ["model_name", "engine"]
        rows = [(label_values, self._families(stats)) for label_values, stats in series]
        for index, (name, doc, kind, _) in enumerate(rows[0][1]):
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc, labels=labels)
            for label_values, values in rows:
                family.add_metric(label_values, float(values[index][3]))
            yield family
        if any(stats.max_loras for _, stats in series):
            yield self._lora_info(labels, series)

    @staticmethod
    def _lora_info(labels: list[str], series: list[tuple[list[str], EngineStatsView]]) -> Metric:
        """vLLM's ``lora_requests_info``: the adapters running and waiting (names, comma-joined)
        and the slots, as labels; its value the time it was read."""
        family = GaugeMetricFamily(
            "pagellm:lora_requests_info", "LoRA adapters of the running and waiting requests (value: when read).",
            labels=[*labels, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        now = time.time()
        for label_values, stats in series:
            running, waiting = (",".join(sorted(names)) for names in (stats.lora_running, stats.lora_waiting))
            family.add_metric([*label_values, str(stats.max_loras), running, waiting], now)
        return family

    @staticmethod
    def _families(s: EngineStatsView) -> list[tuple[str, str, str, float]]:
        """(name, help, kind, value) of every series read from one engine's stats."""
        gauges = [
            ("pagellm:num_requests_running", "Sequences being computed (running in the batch).", s.num_running),
            ("pagellm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("pagellm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", s.kv_cache_usage),
            ("pagellm:kv_cache_shared_blocks", "KV blocks held by more than one sequence.", s.num_shared_blocks),
        ]
        counters = [
            ("pagellm:num_preemptions", "Preemptions (a sequence's KV blocks freed for recompute).",
             s.num_preemptions),
            ("pagellm:prompt_tokens", "Prompt tokens computed (recompute included).", s.num_prompt_tokens),
            ("pagellm:generation_tokens", "Tokens generated.", s.num_generated_tokens),
            ("pagellm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("pagellm:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.", s.prefix_cache_hits),
            ("pagellm:kv_cache_cow_copies", "KV blocks copied because a sequence wrote into a shared block.",
             s.num_cow_copies),
            ("pagellm:spec_decode_num_drafts", "Sequence-steps that verified speculative drafts.", s.spec_num_drafts),
            ("pagellm:spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
             s.spec_num_draft_tokens),
            ("pagellm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.", s.spec_num_accepted_tokens),
            ("pagellm:mm_images", "Images in the requests taken.", s.num_images),
            ("pagellm:mm_images_encoded", "Images the vision encoder ran on (the others: its cache's, or the "
             "prefix cache's).", s.num_images_encoded),
        ]
        if s.disk_tier_capacity_bytes:
            gauges += [
                ("pagellm:disk_tier_capacity_bytes", "Most bytes the disk tier's entries may take.",
                 s.disk_tier_capacity_bytes),
                ("pagellm:disk_tier_used_bytes", "Bytes the disk tier's entries take.", s.disk_tier_used_bytes),
            ]
            counters += [
                ("pagellm:disk_tier_queries", "KV blocks looked up in the disk tier (past the pool's hits).",
                 s.disk_tier_queries),
                ("pagellm:disk_tier_hits", "KV blocks found in the disk tier.", s.disk_tier_hits),
                ("pagellm:disk_tier_loaded_blocks", "KV blocks read from the disk tier into the pool.",
                 s.disk_tier_loaded_blocks),
                ("pagellm:disk_tier_load_failures", "Disk-tier entries refused when read (computed again).",
                 s.disk_tier_load_failures),
                ("pagellm:disk_tier_stored_blocks", "KV blocks sent to the disk tier to be written.",
                 s.disk_tier_stored_blocks),
                ("pagellm:disk_tier_write_failures", "KV blocks the disk tier could not write (disk full, "
                 "read-only, writes behind).", s.disk_tier_write_failures),
                ("pagellm:disk_tier_read_bytes", "Bytes read from the disk tier.", s.disk_tier_bytes_read),
                ("pagellm:disk_tier_read_seconds", "Seconds the disk tier's reader spent.", s.disk_tier_read_seconds),
                ("pagellm:disk_tier_written_bytes", "Bytes written to the disk tier.", s.disk_tier_bytes_written),
                ("pagellm:disk_tier_write_seconds", "Seconds the disk tier's writer spent.", s.disk_tier_write_seconds),
            ]
        return [(name, doc, "gauge", value) for name, doc, value in gauges] + [
            (name, doc, "counter", value) for name, doc, value in counters
        ]


class PrometheusMetrics:
    """The server's metrics registry; the ``observe_*``/``count_*`` methods are thread-safe."""

    def __init__(
        self, model_name: str, stats: Callable[[], EngineStatsView],
        replica_stats: Callable[[], list[EngineStatsView]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._ttft_family = Histogram(
            "pagellm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry,
        )
        self._ttft = self._ttft_family.labels(model_name)
        self._tpot_family = Histogram(
            "pagellm:time_per_output_token_seconds", "Mean time between output tokens of a request (after the first).",
            ["model_name"], buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self._tpot = self._tpot_family.labels(model_name)
        self._e2e = Histogram(
            "pagellm:e2e_request_latency_seconds", "Time from arrival to the last token of a request.",
            ["model_name"], buckets=_E2E_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "pagellm:request_success", "Finished sequences, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"], registry=self.registry,
        )
        self._rejected = Counter(
            "pagellm:requests_rejected", "Requests refused before reaching the engine, by reason (overloaded).",
            ["model_name", "reason"], registry=self.registry,
        )
        self._restarts = Counter(
            "pagellm:engine_restarts", "Times a failed engine was replaced by a fresh one.",
            ["model_name"], registry=self.registry,
        ).labels(model_name)
        self.registry.register(_EngineStatsCollector(model_name, stats, replica_stats))

    def observe_time_to_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def observe_e2e_latency(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def count_finished(self, finish_reason: str) -> None:
        self._finished.labels(self._model_name, finish_reason).inc()

    def count_rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def count_engine_restart(self) -> None:
        self._restarts.inc()

    def latency_counts(self) -> dict[str, HistogramCounts]:
        """The TTFT and TPOT histograms' bucket counts now (``ttft``, ``tpot``): the live page's
        percentiles come from these, the counts ``/metrics`` exposes."""
        return {"ttft": _bucket_counts(self._ttft_family), "tpot": _bucket_counts(self._tpot_family)}

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _bucket_counts(family: Histogram) -> HistogramCounts:
    """One (single-label) histogram's cumulative bucket counts, read through its public samples."""
    bounds: list[float] = []
    counts: list[float] = []
    for metric in family.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bounds.append(float(sample.labels["le"]))
                counts.append(sample.value)
    return HistogramCounts(tuple(bounds), tuple(counts))
