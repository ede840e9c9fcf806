"""Offline throughput: one workload through pagellm, and optionally through HF static batching
and vLLM, in the same run.

Each system runs in its own child process by default (``isolation="process"``) so that its
peak memory is its own and one system's threads, allocator state and imports never slow the
next. Every system is warmed up on a few throw-away requests before the timed run.

Reported per system: requests/s, output tokens/s, total (prompt + output) tokens/s, elapsed
time, peak RSS of the process and start-up time (``LLM()`` construction; model load for HF).
Use ``--repeats`` to run everything several times, interleaved (ours, HF, ours, HF, ...), and
report the median: on a shared machine single runs are noisy.
"""

from __future__ import annotations

import argparse
import ctypes.util
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pagellm.benchmarks._common import (
    bench_engine_options,
    flat_config,
    format_routes,
    format_table,
    machine_info,
    model_token_facts,
    peak_rss_mib,
    reset_peak_rss,
    routes_since,
)
from pagellm.benchmarks.workloads import BenchRequest, Workload, make_workload, workload_from_json, workload_to_json
from pagellm.engine.protocol import EngineStats


@dataclass
class ThroughputResult:
    system: str
    workload: str
    num_requests: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    start_s: float  # engine construction (ours, vLLM) or model load (HF)
    peak_rss_mib: float
    measured_requests: int = 0  # < num_requests when a slow baseline ran a subset (rates extrapolate)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.measured_requests / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def row(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            requests_per_s=self.requests_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
        )
        return data


# ---- pagellm -------------------------------------------------------------------------------


# Options of the benchmark that are not engine options.
_NOT_ENGINE = frozenset({"hf_attn", "results_dir", "vllm_model_dir", "vllm_dtype"})


def llm_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Keep only the options this version of ``LLM`` accepts (``None`` means: engine default)."""
    from pagellm.engine_args import ENGINE_OPTION_NAMES

    accepted = ENGINE_OPTION_NAMES  # LLM(**options) builds EngineArgs
    kwargs = {}
    for key, value in options.items():
        if value is None or key in _NOT_ENGINE:
            continue
        if key not in accepted:
            print(f"note: this LLM has no {key!r} option; ignoring it", file=sys.stderr)
            continue
        kwargs[key] = value
    return kwargs


def disk_tier_counters(stats: EngineStats) -> dict[str, float]:
    """The disk tier's counters of an engine's stats, without their prefix (bench output)."""
    prefix = "disk_tier_"
    return {f.name[len(prefix) :]: getattr(stats, f.name) for f in fields(stats) if f.name.startswith(prefix)}


def _warmup_prompts(workload: Workload, count: int = 2) -> list[dict[str, list[int]]]:
    """A few short prompts that share no prefix with the workload (reversed token order)."""
    prompts = []
    for r in workload.requests[:count]:
        ids = list(reversed(r.prompt_token_ids))[:16] or [r.prompt_token_ids[0]]
        prompts.append({"prompt_token_ids": ids})
    return prompts


# ``--compare json``: every request constrained to a JSON array of objects that cannot close
# within max_tokens, so each writes structured JSON for its whole max_tokens, exactly as many
# tokens as unconstrained.
JSON_BENCH_SCHEMA = {
    "type": "array",
    "minItems": 256,  # longer than any max_tokens here: the document never closes early
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
}


def run_pagellm(
    workload: Workload, options: dict[str, Any], progress: bool = True, structured: bool = False
) -> ThroughputResult:
    """Time ``LLM.generate`` over the whole workload (greedy, per-request max_tokens / ignore_eos),
    each request constrained to ``JSON_BENCH_SCHEMA`` when ``structured``."""
    import torch

    from pagellm import LLM, SamplingParams, StructuredOutputsParams

    reset_peak_rss()
    kwargs = llm_kwargs(options)
    start = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - start
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(_warmup_prompts(workload), warm, use_tqdm=False)

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    constraint = StructuredOutputsParams(json=JSON_BENCH_SCHEMA) if structured else None
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos, structured_outputs=constraint)
        for r in workload.requests
    ]
    engine = llm.llm_engine
    if structured:  # compile (and prepare the vocabulary) before the clock starts, as a warm server has
        llm.generate(_warmup_prompts(workload, 1), [SamplingParams(max_tokens=2, structured_outputs=constraint)],
                     use_tqdm=False)  # fmt: skip
    steps_before = engine.stats.num_steps
    routes_before = dict(engine.stats.step_routes)
    mask_s_before = engine.structured_output.mask_seconds
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - t0
    steps = engine.stats.num_steps - steps_before
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outputs)
    extra = dict(
        engine_kwargs={k: str(v) for k, v in kwargs.items()},
        steps=steps,
        # Time computing the grammars' masks (llguidance), per step; applying them is in the step.
        mask_fill_ms_per_step=(engine.structured_output.mask_seconds - mask_s_before) * 1e3 / max(steps, 1),
        preemptions=engine.stats.num_preemptions,
        cached_prompt_tokens=cached,
        # Includes the warm-up, which is tiny; what the sharing issue asks to show.
        peak_kv_blocks=engine.stats.peak_blocks_in_use,
        prompt_tokens_computed=engine.stats.num_prompt_tokens,
        torch_threads=torch.get_num_threads(),
        kernel_plan=engine.kernel_plan_info,
        step_routes=routes_since(routes_before, engine.stats.step_routes),  # what ran (StepRoute)
    )
    if engine.stats.disk_tier_capacity_bytes:  # (--kv-offload-dir: cumulative, the warm-up included)
        extra["disk_tier"] = disk_tier_counters(engine.stats)
    return ThroughputResult(
        system="pagellm-json" if structured else "pagellm",
        workload=workload.name,
        num_requests=len(workload),
        measured_requests=len(workload),
        elapsed_s=elapsed,
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=output_tokens,
        start_s=start_s,
        peak_rss_mib=peak_rss_mib(),
        extra=extra,
    )


# ---- Hugging Face static batching ---------------------------------------------------------


def run_hf(
    workload: Workload,
    options: dict[str, Any],
    batch_sizes: list[int],
    max_requests: int | None,
    progress: bool = True,
) -> list[ThroughputResult]:
    """``transformers.generate`` in static batches, one result per batch size (model loaded once)."""
    import torch

    from pagellm.benchmarks.hf_baseline import hf_generation_ids, load_hf_model, run_static_batches, subset_indices
    from pagellm.worker.worker import engine_dtype

    if options.get("num_threads"):
        torch.set_num_threads(int(options["num_threads"]))
    reset_peak_rss()
    device = torch.device(options.get("device") or "cpu")
    dtype = engine_dtype(options.get("dtype") or "auto", options.get("model"), device)
    start = time.perf_counter()
    model = load_hf_model(options.get("model"), dtype, attn_implementation=options.get("hf_attn") or "sdpa").to(device)
    start_s = time.perf_counter() - start
    _, special = model_token_facts(options.get("model"))
    eos_ids, pad_id = hf_generation_ids(model, special)
    warm = Workload("warmup", [BenchRequest(p["prompt_token_ids"], 4, True) for p in _warmup_prompts(workload)])
    run_static_batches(model, warm, len(warm), eos_ids, pad_id, progress=False)

    results = []
    for batch_size in batch_sizes:
        indices = subset_indices(len(workload), batch_size, max_requests)
        part = workload if indices is None else workload.subset(indices)
        reset_peak_rss()
        res = run_static_batches(model, part, batch_size, eos_ids, pad_id, progress=progress)
        results.append(
            ThroughputResult(
                system=f"hf-static-b{batch_size}",
                workload=workload.name,
                num_requests=len(workload),
                measured_requests=res.num_requests,
                elapsed_s=res.elapsed_s,
                prompt_tokens=res.prompt_tokens,
                output_tokens=res.output_tokens,
                start_s=start_s,
                peak_rss_mib=peak_rss_mib(),
                extra=dict(
                    batch_size=batch_size,
                    batches=res.batches,
                    computed_tokens=res.computed_tokens,
                    extrapolated=indices is not None,
                    attn_implementation=options.get("hf_attn") or "sdpa",
                    torch_threads=torch.get_num_threads(),
                ),
            )
        )
    return results


# ---- vLLM (only when installed) ------------------------------------------------------------


def vllm_available(python: str | None = None) -> bool:
    """Whether ``import vllm`` works here, or in the interpreter ``python`` (another venv)."""
    if python is None:
        return importlib.util.find_spec("vllm") is not None
    try:
        proc = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=600, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


# vLLM's CPU build: a KV space of its own (GiB) and no core held back for its scheduler
# (docs/peers.md). Only set when the caller has not.
VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def vllm_child_env(python: str | None, env: dict[str, str]) -> dict[str, str]:
    """The environment of a vLLM child: ``VLLM_CPU_ENV`` where unset and, as vLLM's CPU build
    recommends, its bundled ``libiomp5.so`` and tcmalloc preloaded when both are found and
    ``LD_PRELOAD`` is unset, so the comparison meets vLLM as its docs tell users to run it."""
    env = dict(env)
    for key, value in VLLM_CPU_ENV.items():
        env.setdefault(key, value)
    if env.get("LD_PRELOAD"):
        return env
    prefix = Path(python).absolute().parent.parent if python else Path(sys.prefix)  # the venv, not its base
    iomp = prefix / "lib" / "libiomp5.so"
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if iomp.is_file() and tcmalloc:
        env["LD_PRELOAD"] = f"{tcmalloc}:{iomp}"
    return env


def export_hf_folder(model: str | None, folder: Path) -> Path:
    """vLLM needs an HF folder: write the (dequantized) model and its tokenizer once."""
    if (folder / "config.json").is_file():
        return folder
    import torch

    from pagellm.benchmarks.hf_baseline import load_hf_model
    from pagellm.model.tokenizer import load_tokenizer

    net = load_hf_model(model, torch.float32, attn_implementation="sdpa")
    folder.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(model).save_pretrained(folder)
    return folder


def run_vllm(workload: Workload, options: dict[str, Any], progress: bool = True) -> ThroughputResult:
    from vllm import LLM as VLLM  # type: ignore[import-not-found]
    from vllm import SamplingParams as VSamplingParams  # type: ignore[import-not-found]

    path = options.get("vllm_model_dir")
    if path is None:
        from pagellm.model.loader import is_gguf, resolve_model_path

        path = resolve_model_path(options.get("model"))
        if is_gguf(path):
            path = str(export_hf_folder(options.get("model"), Path(options["results_dir"]) / "hf_export"))
    reset_peak_rss()
    dtype = options.get("vllm_dtype") or options.get("dtype") or "bfloat16"
    kwargs: dict[str, Any] = dict(model=path, dtype=dtype, seed=0)
    if options.get("max_num_seqs"):
        kwargs["max_num_seqs"] = options["max_num_seqs"]
    # The model's context (131,072 at Llama 3.2) needs more than vLLM's 4 GiB KV space for one
    # request, and vLLM refuses to start: the workload's longest request, at least 2,048.
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    kwargs["max_model_len"] = options.get("max_model_len") or max(2048, longest)
    if options.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = options["max_num_batched_tokens"]
    if options.get("enable_prefix_caching") is not None:
        kwargs["enable_prefix_caching"] = options["enable_prefix_caching"]
    if options.get("kv_cache_dtype") not in (None, "auto"):
        kwargs["kv_cache_dtype"] = options["kv_cache_dtype"]
    start = time.perf_counter()
    llm = VLLM(**kwargs)
    start_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [
        VSamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=r.ignore_eos) for r in workload.requests
    ]
    llm.generate(prompts[:2], [VSamplingParams(temperature=0.0, max_tokens=4)] * 2, use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - t0
    return ThroughputResult(
        system="vllm",
        workload=workload.name,
        num_requests=len(workload),
        measured_requests=len(workload),
        elapsed_s=elapsed,
        prompt_tokens=workload.num_prompt_tokens,
        output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
        start_s=start_s,
        peak_rss_mib=peak_rss_mib(),  # this process only: vLLM's engine-core child is not counted
        extra=dict(note="peak RSS excludes vLLM's engine-core process", dtype=dtype),
    )


# ---- jobs: one system, in this process or a child -------------------------------------------


def run_job(job: dict[str, Any]) -> list[ThroughputResult]:
    workload = workload_from_json(job["workload"])
    system, options, progress = job["system"], job["options"], job.get("progress", True)
    if system in ("pagellm", "pagellm-json"):
        return [run_pagellm(workload, options, progress, structured=system == "pagellm-json")]
    if system == "hf":
        return run_hf(workload, options, job["batch_sizes"], job.get("max_requests"), progress)
    if system == "vllm":
        return [run_vllm(workload, options, progress)]
    raise ValueError(f"unknown system {system!r}")


def run_job_isolated(job: dict[str, Any]) -> list[ThroughputResult]:
    """Run a job in a fresh Python process (its own memory peak, threads and allocator);
    ``job["python"]`` picks another interpreter (e.g. a venv with vLLM)."""
    with tempfile.TemporaryDirectory(prefix="pagellm-bench-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        python = job.get("python") or sys.executable
        cmd = [python, "-m", "pagellm.benchmarks.throughput", "--job", str(job_path), "--result", str(result_path)]
        env = vllm_child_env(job.get("python"), dict(os.environ)) if job["system"] == "vllm" else dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the pagellm package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"benchmark child for {job['system']!r} failed with exit code {proc.returncode}")
        rows = json.loads(result_path.read_text())
    return [ThroughputResult(**row) for row in rows]


def _job_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="internal: run one benchmark job")
    parser.add_argument("--job", required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    job = json.loads(Path(args.job).read_text())
    results = run_job(job)
    Path(args.result).write_text(json.dumps([asdict(r) for r in results]))


# ---- the benchmark ----------------------------------------------------------------------------


@dataclass
class ThroughputConfig:
    workload: str = "fixed"
    num_prompts: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    prefix_len: int | None = None
    suffix_len: int | None = None
    seed: int = 0  # the workload's
    # EngineArgs fields for pagellm (the rest: the engine's defaults), read by HF and vLLM runs
    # too where they apply (model, dtype, device, max_num_seqs, kv_cache_dtype, ...).
    engine: dict[str, Any] = field(default_factory=dict)
    compare: list[str] = field(default_factory=list)  # "hf", "vllm", "json"
    hf_batch_sizes: list[int] = field(default_factory=lambda: [64])
    hf_max_requests: int | None = None
    hf_attn: str = "sdpa"
    vllm_python: str | None = None  # interpreter of a venv where `import vllm` works
    # vLLM's dtype where it differs from pagellm's (default: pagellm's, else bfloat16): a CPU
    # without AVX-512 BF16 runs vLLM fastest in float32, pagellm in its own quantized format.
    vllm_dtype: str | None = None
    repeats: int = 1
    isolation: str = "process"  # or "none"
    progress: bool = True
    results_dir: str = "benchmarks/results"

    def __post_init__(self) -> None:
        self.engine = bench_engine_options(self.engine)

    @property
    def model(self) -> str | None:
        return self.engine.get("model")


def build_workload(cfg: ThroughputConfig) -> Workload:
    vocab_size, special = model_token_facts(cfg.model)
    return make_workload(
        cfg.workload,
        vocab_size,
        num_prompts=cfg.num_prompts,
        seed=cfg.seed,
        special_ids=special,
        input_len=cfg.input_len,
        output_len=cfg.output_len,
        prefix_len=cfg.prefix_len,
        suffix_len=cfg.suffix_len,
    )


def _median_result(runs: list[ThroughputResult]) -> ThroughputResult:
    """The run with the median elapsed time, annotated with the spread over all runs."""
    ordered = sorted(runs, key=lambda r: r.elapsed_s)
    best = ordered[len(ordered) // 2]
    if len(runs) > 1:
        rates = [r.output_tokens_per_s for r in runs]
        best.extra = dict(
            best.extra,
            repeats=len(runs),
            output_tokens_per_s_runs=rates,
            spread_pct=100 * (max(rates) - min(rates)) / statistics.median(rates),
        )
    return best


def run_throughput(cfg: ThroughputConfig) -> dict[str, Any]:
    """Run the configured systems (interleaved when repeating); returns the JSON report."""
    workload = build_workload(cfg)
    options = dict(cfg.engine, hf_attn=cfg.hf_attn, results_dir=cfg.results_dir, vllm_dtype=cfg.vllm_dtype)
    jobs: list[dict[str, Any]] = [dict(system="pagellm")]
    skipped = []
    for other in cfg.compare:
        if other == "hf":
            jobs.append(dict(system="hf", batch_sizes=cfg.hf_batch_sizes, max_requests=cfg.hf_max_requests))
        elif other == "json":
            jobs.append(dict(system="pagellm-json"))
        elif other == "vllm":
            if vllm_available(cfg.vllm_python):
                job: dict[str, Any] = dict(system="vllm")
                if cfg.vllm_python:
                    job["python"] = cfg.vllm_python
                    # The other venv only runs vLLM: convert a GGUF model to an HF folder here.
                    from pagellm.model.loader import is_gguf, resolve_model_path

                    if is_gguf(resolve_model_path(cfg.model)):
                        folder = export_hf_folder(cfg.model, Path(cfg.results_dir) / "hf_export")
                        options["vllm_model_dir"] = str(folder.resolve())
                jobs.append(job)
            else:
                where = f"with {cfg.vllm_python}" if cfg.vllm_python else "here"
                skipped.append(f"vllm: `import vllm` does not work {where} (docs/peers.md says how to install it)")
        else:
            raise ValueError(f"unknown --compare system {other!r}; choose hf, vllm or json")
    for note in skipped:
        print(f"skipping {note}", file=sys.stderr)

    def runner(job: dict[str, Any]) -> list[ThroughputResult]:
        if cfg.isolation == "process" or job.get("python"):
            return run_job_isolated(job)
        return run_job(job)

    payload = workload_to_json(workload)
    by_system: dict[str, list[ThroughputResult]] = {}
    failed: set[str] = set()
    for _ in range(cfg.repeats):
        for job in jobs:
            if job["system"] in failed:
                continue
            full = dict(job, workload=payload, options=options, progress=cfg.progress)
            try:
                results = runner(full)
            except Exception as exc:  # a comparison system that fails must not lose our numbers
                if job["system"] == "pagellm":
                    raise
                failed.add(job["system"])
                skipped.append(f"{job['system']}: failed ({type(exc).__name__}: {exc})")
                print(f"{job['system']} failed: {exc}", file=sys.stderr)
                continue
            for result in results:
                by_system.setdefault(result.system, []).append(result)
    results = [_median_result(runs) for runs in by_system.values()]
    ours = next((r for r in results if r.system == "pagellm"), None)
    rows = []
    for r in results:
        row = r.row()
        if ours is not None and r is not ours and r.output_tokens_per_s > 0:
            row["ours_vs_this"] = ours.output_tokens_per_s / r.output_tokens_per_s
        rows.append(row)
    return dict(
        benchmark="throughput",
        workload=workload.describe(),
        config=flat_config(cfg),
        machine=machine_info(),
        skipped=skipped,
        results=rows,
    )


TABLE_COLUMNS = [
    ("system", "system", ""),
    ("measured_requests", "reqs", "d"),
    ("elapsed_s", "time s", ".1f"),
    ("requests_per_s", "req/s", ".2f"),
    ("output_tokens_per_s", "out tok/s", ".1f"),
    ("total_tokens_per_s", "total tok/s", ".1f"),
    ("peak_rss_mib", "peak RSS MiB", ".0f"),
    ("start_s", "start s", ".1f"),
    ("ours_vs_this", "pagellm x", ".2f"),
]


def format_report(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"workload {w['name']}: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens "
        f"(mean {w['prompt_len_mean']:.0f}), max_tokens total {w['max_tokens_total']} "
        f"(mean {w['max_tokens_mean']:.0f}), ignore_eos={w['ignore_eos']}",
        format_table(report["results"], TABLE_COLUMNS),
    ]
    if report["config"].get("device") == "cuda":
        lines.insert(1, f"device cuda ({report['machine'].get('gpu')}), dtype {report['config']['dtype']}")
    for row in report["results"]:
        if row.get("extra", {}).get("extrapolated"):
            lines.append(
                f"  {row['system']}: ran {row['measured_requests']} of {row['num_requests']} requests; rates extrapolate"
            )
        note = row.get("extra", {}).get("note")
        if note:
            lines.append(f"  {row['system']}: {note}")
        extra = row.get("extra", {})
        if "peak_kv_blocks" in extra:
            lines.append(
                f"  {row['system']}: peak KV blocks {extra['peak_kv_blocks']}, prompt tokens computed "
                f"{extra['prompt_tokens_computed']}, served from the prefix cache {extra['cached_prompt_tokens']}"
            )
        if "step_routes" in extra:
            lines.append(f"  {row['system']}: step routes: {format_routes(extra['step_routes'])}")
        tier = extra.get("disk_tier")
        if tier:
            lines.append(f"  {row['system']}: disk tier: {tier['loaded_blocks']} blocks loaded, {tier['stored_blocks']} "
                         f"written ({tier['write_failures']} refused), {tier['used_bytes'] / 2**20:.0f} MiB held; read "
                         f"{tier['bytes_read'] / 2**20:.0f} MiB in {tier['read_seconds']:.2f} s, wrote "
                         f"{tier['bytes_written'] / 2**20:.0f} MiB in {tier['write_seconds']:.2f} s")  # fmt: skip
        spread = extra.get("spread_pct")
        if spread is not None:
            lines.append(f"  {row['system']}: median of {row['extra']['repeats']} runs, spread {spread:.0f}%")
    for note in report.get("skipped", []):
        lines.append(f"  skipped {note}")
    return "\n".join(lines)


if __name__ == "__main__":
    _job_main(sys.argv[1:])
