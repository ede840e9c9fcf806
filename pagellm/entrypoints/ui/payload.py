"""The live page's snapshot as JSON: the engine's ``KVSnapshot`` plus the counters the server
already keeps (``EngineStats``, the latency histograms of ``/metrics``).

Compact on purpose: the pool's per-cell arrays travel as one zlib-compressed, base64 blob
(``position`` int32, ``owner`` int16, ``ref_cnt`` uint8, ``cached`` uint8, little-endian, one
array after the other; the page inflates it with the browser's ``DecompressionStream``), not as
a JSON list per block. The sizes are bounded by the snapshot's own caps (see
``pagellm.core.kv_snapshot``): at most 16,384 cells (8 bytes each before compression), 64
requests and 256 table entries per request.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import asdict
from typing import Any

import numpy as np

from pagellm.engine.protocol import EngineStats, KVSnapshot
from pagellm.metrics.histogram import HistogramCounts

CELL_LAYOUT = ["position:int32", "owner:int16", "ref_cnt:uint8", "cached:uint8"]
QUANTILES = (0.5, 0.9, 0.99)


def encode_cells(snapshot: KVSnapshot) -> str:
    """The per-cell arrays in ``CELL_LAYOUT`` order, compressed (zlib, fastest level) and base64'd."""
    raw = b"".join([
        snapshot.position.astype("<i4", copy=False).tobytes(),
        snapshot.owner.astype("<i2", copy=False).tobytes(),
        snapshot.ref_cnt.astype(np.uint8, copy=False).tobytes(),
        snapshot.cached.astype(np.uint8, copy=False).tobytes(),
    ])  # fmt: skip
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def latency_summary(window: dict[str, HistogramCounts], total: dict[str, HistogramCounts]) -> dict[str, Any]:
    """Percentiles (seconds) of each latency over the window, with the window's and the run's counts."""
    summary: dict[str, Any] = {}
    for name, counts in window.items():
        entry: dict[str, Any] = {f"p{round(q * 100)}": counts.quantile(q) for q in QUANTILES}
        entry["count"] = counts.count
        entry["total"] = total[name].count
        summary[name] = entry
    return summary


def build_payload(
    snapshot: KVSnapshot, stats: EngineStats, replica: int, num_replicas: int, model: str,
    latency: dict[str, Any], now: float,
) -> dict[str, Any]:
    """The JSON object one snapshot event carries (the page reads exactly these keys)."""
    return {
        "version": 1,
        "time": now,
        "build_seconds": snapshot.build_seconds,  # what the snapshot cost the engine
        "model": model,
        "replica": replica,
        "num_replicas": num_replicas,
        "pool": {
            "num_blocks": snapshot.num_blocks,
            "block_size": snapshot.block_size,
            "blocks_per_cell": snapshot.blocks_per_cell,
            "num_cells": snapshot.num_cells,
            "num_free": snapshot.num_free_blocks,
            "num_cached_free": snapshot.num_cached_free_blocks,
            "num_shared": snapshot.num_shared_blocks,
            "disk_tier_blocks": snapshot.disk_tier_blocks,
            "disk_tier_capacity": snapshot.disk_tier_capacity,  # 0: no disk tier
        },
        "cells": {"encoding": "zlib+base64", "layout": CELL_LAYOUT, "data": encode_cells(snapshot)},
        "queues": {
            "running": snapshot.num_running,
            "waiting": snapshot.num_waiting,
            "preempted": snapshot.num_preempted,
            "forking": snapshot.num_forking,
            "listed": len(snapshot.sequences),
        },
        "requests": [
            {
                "id": r.seq_id, "status": r.status, "computed": r.num_computed_tokens, "tokens": r.num_tokens,
                "prompt": r.num_prompt_tokens, "cached": r.num_cached_tokens, "preemptions": r.num_preemptions,
                "blocks": r.num_blocks, "released": r.num_released, "table": r.block_ids, "priority": r.priority,
            }
            for r in snapshot.sequences
        ],  # fmt: skip
        "stats": asdict(stats),
        "latency": latency,
    }
