"""The summary figure: throughput against concurrency, and KV memory held per request.

``run_sweep`` measures output tokens/s of pagellm with ``max_num_seqs = c`` (and, with
``compare_hf``, of HF static batching with batch size ``c``) on a ``fixed`` workload of
``max(min_prompts, prompts_per_seq * c)`` requests, for each concurrency ``c``. Everything runs
in this process, one system after the other, each warmed up first.

``plot_summary`` draws the sweep (left) and the memory benchmark's reserved slots per request,
split into slots holding tokens and empty reserved slots (right), into one PNG.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from pagellm.benchmarks._common import bench_extra, format_table, machine_info
from pagellm.benchmarks.workloads import fixed_workload


def run_sweep(
    concurrency: list[int],
    model: str | None = None,
    dtype: str = "bfloat16",
    input_len: int = 128,
    output_len: int = 128,
    prompts_per_seq: int = 2,
    min_prompts: int = 4,
    compare_hf: bool = False,
    engine_options: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    from pagellm.benchmarks._common import model_token_facts
    from pagellm.benchmarks.throughput import run_pagellm

    vocab_size, special = model_token_facts(model)
    points = []
    hf_model = None
    hf_ids = None
    for c in concurrency:
        workload = fixed_workload(
            vocab_size, max(min_prompts, prompts_per_seq * c), input_len, output_len, special_ids=special
        )
        options = dict(engine_options or {}, model=model, dtype=dtype, max_num_seqs=c)
        ours = run_pagellm(workload, options, progress=progress)
        gc.collect()
        point: dict[str, Any] = dict(
            concurrency=c, num_requests=len(workload), pagellm_output_tokens_per_s=ours.output_tokens_per_s
        )
        if compare_hf:
            from pagellm.benchmarks.hf_baseline import hf_generation_ids, load_hf_model, run_static_batches
            import torch

            from pagellm.worker.worker import engine_dtype

            if hf_model is None:
                hf_model = load_hf_model(model, engine_dtype(dtype, model, torch.device("cpu")))
                hf_ids = hf_generation_ids(hf_model, special)
                warm = fixed_workload(vocab_size, 1, 16, 4, seed=1, special_ids=special)
                run_static_batches(hf_model, warm, 1, *hf_ids, progress=False)
            assert hf_ids is not None
            res = run_static_batches(hf_model, workload, c, *hf_ids, progress=progress)
            point["hf_output_tokens_per_s"] = res.output_tokens / res.elapsed_s
        points.append(point)
    return dict(
        benchmark="sweep",
        config=dict(model=model, dtype=dtype, input_len=input_len, output_len=output_len,
                    prompts_per_seq=prompts_per_seq, min_prompts=min_prompts),
        machine=machine_info(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        points=points,
    )


def format_sweep(report: dict[str, Any]) -> str:
    return format_table(
        report["points"],
        [
            ("concurrency", "concurrency", "d"),
            ("num_requests", "requests", "d"),
            ("pagellm_output_tokens_per_s", "pagellm out tok/s", ".1f"),
            ("hf_output_tokens_per_s", "hf static out tok/s", ".1f"),
        ],
    )


def plot_summary(sweep: dict[str, Any] | None, memory: dict[str, Any] | None, path: str, title: str = "") -> str:
    """Write the figure to ``path`` (PNG); either panel may be missing."""
    matplotlib = bench_extra("matplotlib", "pagellm bench sweep's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (sweep, memory) if p is not None]
    if not panels:
        raise ValueError("nothing to plot: give a sweep and/or a memory report")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    axes = list(axes[0])
    if sweep is not None:
        ax = axes.pop(0)
        pts = sweep["points"]
        xs = [p["concurrency"] for p in pts]
        ax.plot(xs, [p["pagellm_output_tokens_per_s"] for p in pts], "o-", label="pagellm (continuous batching)")
        if any("hf_output_tokens_per_s" in p for p in pts):
            hx = [p["concurrency"] for p in pts if "hf_output_tokens_per_s" in p]
            hy = [p["hf_output_tokens_per_s"] for p in pts if "hf_output_tokens_per_s" in p]
            ax.plot(hx, hy, "s--", label="HF generate (static batch = concurrency)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency (max_num_seqs / batch size)")
        ax.set_ylabel("output tokens / s")
        cfg = sweep["config"]
        ax.set_title(f"throughput, {cfg['input_len']}+{cfg['output_len']} tokens, {cfg['dtype']}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if memory is not None:
        ax = axes.pop(0)
        rows = memory["results"]
        bpt = memory.get("bytes_per_token")
        scale = (bpt / 2**20) if bpt else 1.0
        unit = "MiB" if bpt else "token slots"
        names = [r["allocator"] for r in rows]
        used = [r["mean_tokens_per_request"] * scale for r in rows]
        empty = [(r["mean_reserved_per_request"] - r["mean_tokens_per_request"]) * scale for r in rows]
        ax.bar(names, used, label="holding tokens")
        ax.bar(names, empty, bottom=used, label="reserved, empty")
        for i, r in enumerate(rows):
            ax.text(i, used[i] + empty[i], f"max {r['max_requests_held']} reqs", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel(f"KV memory per running request ({unit})")
        cfg = memory["config"]
        ax.set_title(f"KV held per request, {cfg['workload']} workload, same budget")
        ax.legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
