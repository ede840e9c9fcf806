"""Start-up: how long a fresh process takes from launch to an engine ready to serve, and the
most memory it holds on the way.

Each round starts a new Python process that imports pagellm, builds ``LLM(MODEL, ...)`` and
reports; the parent times launch to ready (imports included: what a user waits for; the child's
exit apart), the child its own import and engine build times, its first request (one prompt
token in, one out: where weights mapped from a file, ``--packed-weights-cache-size``, are first
read) and its peak resident memory after it (``ru_maxrss``: packed weights, the KV pool as far
as it was touched, the runtime, and any file pages still mapped).
The floor a peak is measured against is the weights (the model file's bytes) plus the KV pool;
the pool's pages are touched only as blocks are first written, so with the default
``kv_cache_memory=auto`` (a pool of most of the free memory) the ratio to the weights alone is
the one that says what loading cost.
Run it twice in a row for a warm page cache (the first round of a cold file reads the disk).

    pagellm bench startup --model llama-8b-q4km.gguf --repeats 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.benchmarks._common import format_table, machine_info

_CHILD = r"""
import json, resource, sys, time
start = time.monotonic()  # (system-wide: the parent reads the same clock)
from pagellm import LLM
imported = time.monotonic()
llm = LLM(**json.loads(sys.argv[1]))
ready = time.monotonic()
from pagellm import SamplingParams
llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
answered = time.monotonic()
engine = llm.llm_engine
token_bytes = engine.executor.arch.kv_cache_bytes_per_token(engine.executor.kv_cache_dtype)
print("PAGELLM-STARTUP " + json.dumps({
    "import_s": imported - start, "engine_s": ready - imported, "first_request_s": answered - ready,
    "ready_monotonic": ready, "answered_monotonic": answered,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "kv_pool_bytes": engine.executor.num_blocks * engine.config.cache.block_size * token_bytes,
}), flush=True)
"""


@dataclass
class StartupConfig:
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # further LLM(...) options
    repeats: int = 3


def _one_round(cfg: StartupConfig) -> dict[str, Any]:
    """One fresh process: launch to its ready report (what a user waits for), and on to its exit
    apart (a process of several GB takes a fraction of a second to give its pages back). Both
    processes read the one system-wide monotonic clock."""
    options = {"model": cfg.model, **cfg.engine}
    launched = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(options)], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    exited = time.monotonic()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PAGELLM-STARTUP ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the start-up round failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(lines[-1].removeprefix("PAGELLM-STARTUP "))
    ready, answered = report.pop("ready_monotonic"), report.pop("answered_monotonic")
    return {"launch_to_ready_s": ready - launched, "ready_to_exit_s": exited - answered, **report}


def run_startup(cfg: StartupConfig) -> dict[str, Any]:
    """Rounds one after another; medians and each round."""
    from pagellm.model.loader import is_gguf, resolve_model_path, safetensors_files

    path = resolve_model_path(cfg.model)
    weights = os.path.getsize(path) if is_gguf(path) else sum(f.stat().st_size for f in safetensors_files(path))
    rounds = [_one_round(cfg) for _ in range(cfg.repeats)]
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    floor = weights + median["kv_pool_bytes"]
    return {
        "benchmark": "startup", "model": path, "engine": cfg.engine, "machine": machine_info(),
        "weights_bytes": weights, "median": median, "rounds": rounds,
        "peak_rss_over_weights_plus_kv": median["peak_rss_bytes"] / floor,
        "peak_rss_over_weights": median["peak_rss_bytes"] / weights,
    }


def format_report(report: dict[str, Any]) -> str:
    gb = 1e9
    rows = [{"round": i + 1, **r} for i, r in enumerate(report["rounds"])] + [{"round": "median", **report["median"]}]
    for row in rows:
        row["peak_rss_gb"] = row["peak_rss_bytes"] / gb
    table = format_table(rows, [
        ("round", "round", ""), ("launch_to_ready_s", "launch->ready s", ".2f"), ("import_s", "import s", ".2f"),
        ("engine_s", "engine s", ".2f"), ("first_request_s", "first request s", ".2f"),
        ("ready_to_exit_s", "exit s", ".2f"), ("peak_rss_gb", "peak RSS GB", ".2f"),
    ])  # fmt: skip
    return (f"start-up of {report['model']}: weights {report['weights_bytes'] / gb:.2f} GB, KV pool "
            f"{report['median']['kv_pool_bytes'] / gb:.2f} GB\n{table}\n"
            f"peak RSS / (weights + KV pool): {report['peak_rss_over_weights_plus_kv']:.3f}; "
            f"peak RSS / weights: {report['peak_rss_over_weights']:.3f}")
