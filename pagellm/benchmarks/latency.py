"""``pagellm bench latency``: one user at a time (batch 1), prefill and decode tokens per second.

One request of ``input_len`` random prompt tokens generates ``output_len`` greedy tokens (EOS
ignored), ``repeats`` times, each with a fresh prompt (no prefix-cache hits). Prefill tok/s is
``input_len`` over the time to the first token; decode tok/s is the other ``output_len - 1``
tokens over the time after it. The engine is stepped directly, so the figures include the
scheduler, the output processing and detokenization, as a user of ``LLM`` sees them; the kernel
plan is in the report. What single-user latency targets (issue P3) are measured with.

With ``compare=["llamacpp"]`` the same GGUF file is also run through llama.cpp's ``llama-bench``
(``-p input_len -n output_len -r 1``, the same thread count, no GPU layers) as a reference, once
after each of pagellm's repeats, so that a shared machine's slow and fast phases fall on both
systems alike; the report gains llama.cpp's mean over those runs and pagellm-over-llama.cpp
ratios. Building llama-bench: docs/llama-bench.md.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.benchmarks._common import (
    bench_engine_options,
    flat_config,
    format_routes,
    format_table,
    machine_info,
    model_token_facts,
    peak_rss_mib,
    routes_since,
)
from pagellm.benchmarks.workloads import fixed_workload

COMPARE_CHOICES = ("llamacpp",)
LLAMA_BENCH_DOC = "docs/llama-bench.md"
# Fields of a llama-bench JSON entry kept in the report: which build, CPU and model it measured.
_LLAMA_BENCH_INFO = ("build_commit", "build_number", "cpu_info", "backends", "model_type", "n_threads")


@dataclass
class LatencyConfig:
    engine: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields (the rest: the engine's defaults)
    input_len: int = 128
    output_len: int = 256
    repeats: int = 3
    seed: int = 0  # the prompts'
    compare: list[str] = field(default_factory=list)  # "llamacpp": also run llama-bench on the same GGUF
    llama_bench: str | None = None  # the llama-bench executable, for compare=["llamacpp"]

    def __post_init__(self) -> None:
        self.engine = bench_engine_options(self.engine)
        if self.input_len < 1 or self.output_len < 2 or self.repeats < 1:
            raise ValueError("latency needs input_len >= 1, output_len >= 2 and repeats >= 1")
        unknown = sorted(set(self.compare) - set(COMPARE_CHOICES))
        if unknown:
            raise ValueError(f"unknown latency compare system(s) {unknown}; choose from {list(COMPARE_CHOICES)}")

    @property
    def model(self) -> str | None:
        return self.engine.get("model")

    @property
    def num_threads(self) -> int | None:
        return self.engine.get("num_threads")


def _time_one(engine: Any, request_id: str, prompt: list[int], output_len: int) -> dict[str, float]:
    """Run one request alone; seconds to the first token and for the rest."""
    from pagellm import SamplingParams
    from pagellm.engine.protocol import EngineRequest

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_engine_request(EngineRequest(request_id, prompt, params, stream=True))
    first = None
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():  # streamed: each output holds only the new tokens
            generated += len(output.outputs[0].token_ids)
            if first is None and generated:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None or generated != output_len:
        raise RuntimeError(f"expected {output_len} tokens, got {generated}")
    return dict(
        ttft_s=first - start,
        decode_s=end - first,
        prefill_tokens_per_s=len(prompt) / (first - start),
        decode_tokens_per_s=(output_len - 1) / (end - first),
    )


def run_latency(cfg: LatencyConfig) -> dict[str, Any]:
    """Build the engine once, warm it up, then time ``repeats`` single requests (then llama-bench, if asked)."""
    from pagellm import LLM

    # Checked first, so a missing binary or a non-GGUF model fails before minutes of pagellm timing.
    binary = llama_bench_binary(cfg.llama_bench) if "llamacpp" in cfg.compare else None
    gguf = gguf_model_path(cfg.model) if binary else None
    llm = LLM(**(cfg.engine | dict(max_num_seqs=1, enable_prefix_caching=False)))
    engine = llm.llm_engine
    vocab_size, special = model_token_facts(cfg.model)
    prompts = fixed_workload(vocab_size, cfg.repeats + 1, cfg.input_len, cfg.output_len, cfg.seed, special)
    _time_one(engine, "warmup", prompts.requests[0].prompt_token_ids[:16], 4)
    routes_before = dict(engine.stats.step_routes)
    runs, llama_runs = [], []
    for i, r in enumerate(prompts.requests[1:]):
        runs.append(_time_one(engine, f"latency-{i}", r.prompt_token_ids, cfg.output_len))
        if binary and gguf:  # the idle engine only holds memory (135M parameters: a few hundred MiB)
            llama_runs.append(run_llama_bench(llama_bench_command(binary, gguf, cfg, _pagellm_threads(cfg), repeats=1)))
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    report = dict(config=flat_config(cfg), machine=machine_info(), kernel_plan=engine.kernel_plan_info, runs=runs,
                  median=medians, peak_rss_mib=peak_rss_mib(),
                  step_routes=routes_since(routes_before, engine.stats.step_routes))  # fmt: skip
    if llama_runs:
        report["llamacpp"] = combine_llama_runs(llama_runs)
        report["pagellm_over_llamacpp"] = llamacpp_ratios(medians, report["llamacpp"])
    return report


# ---- llama.cpp reference (llama-bench) ---------------------------------------------------


def llama_bench_binary(path: str | None) -> str:
    """The llama-bench executable; fails up front, saying how to build it, when it is not there."""
    how = f"build it from the llama-cpp-python sdist as described in {LLAMA_BENCH_DOC} and pass --llama-bench PATH"
    if not path:
        raise FileNotFoundError(f"--compare llamacpp needs the llama-bench binary: {how}")
    found = shutil.which(path)  # a path or a name on PATH; None unless an executable file
    if found is None:
        raise FileNotFoundError(f"llama-bench not found (or not executable) at {path!r}: {how}")
    return found


def gguf_model_path(model: str | None) -> str:
    """The GGUF file both engines load: llama-bench reads only GGUF, so anything else is refused."""
    from pagellm.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise ValueError(f"--compare llamacpp needs a .gguf model (llama-bench reads only GGUF), got {path}")
    return path


def _pagellm_threads(cfg: LatencyConfig) -> int:
    """The thread count pagellm ran with (the engine has set torch's by now), for llama-bench ``-t``."""
    import torch

    return cfg.num_threads or torch.get_num_threads()


def llama_bench_command(
    binary: str, model_path: str, cfg: LatencyConfig, threads: int, repeats: int | None = None
) -> list[str]:
    """llama-bench arguments that mirror pagellm's run: same file, lengths, threads and repeats
    (or ``repeats``), CPU only."""
    return [binary, "-m", model_path, "-p", str(cfg.input_len), "-n", str(cfg.output_len),
            "-r", str(cfg.repeats if repeats is None else repeats), "-t", str(threads), "-ngl", "0", "-o", "json"]


def combine_llama_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """llama.cpp's figures over several llama-bench runs: the mean of each phase's tok/s, their
    spread across runs, and the first run's facts (lengths, build, command)."""
    combined = dict(runs[0], runs=len(runs))
    for phase in ("prefill", "decode"):
        rates = [run[f"{phase}_tokens_per_s"] for run in runs]
        combined[f"{phase}_tokens_per_s"] = statistics.fmean(rates)
        combined[f"{phase}_stddev_tokens_per_s"] = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return combined


def parse_llama_bench(text: str) -> dict[str, Any]:
    """Prefill and decode tok/s from ``llama-bench -o json`` stdout: one pp entry (n_gen 0), one tg (n_prompt 0)."""
    start = text.find("[")
    if start < 0:
        raise ValueError(f"no JSON array in llama-bench output: {text[:200]!r}")
    entries: list[dict[str, Any]] = json.loads(text[start:])
    prefill = [e for e in entries if e["n_prompt"] > 0 and e["n_gen"] == 0]
    decode = [e for e in entries if e["n_gen"] > 0 and e["n_prompt"] == 0]
    if len(prefill) != 1 or len(decode) != 1:
        raise ValueError(f"expected one prefill and one decode test from llama-bench, "
                         f"got {len(prefill)} and {len(decode)}")
    pp, tg = prefill[0], decode[0]
    return dict(
        prefill_tokens_per_s=float(pp["avg_ts"]), prefill_stddev_tokens_per_s=float(pp["stddev_ts"]),
        decode_tokens_per_s=float(tg["avg_ts"]), decode_stddev_tokens_per_s=float(tg["stddev_ts"]),
        n_prompt=int(pp["n_prompt"]), n_gen=int(tg["n_gen"]), build={k: pp[k] for k in _LLAMA_BENCH_INFO if k in pp},
    )


def run_llama_bench(command: list[str]) -> dict[str, Any]:
    """Run llama-bench once and parse it; on failure its stderr is shown, since that is where it says why."""
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {proc.returncode}): {shlex.join(command)}\n{proc.stderr[-2000:]}")
    return dict(parse_llama_bench(proc.stdout), command=shlex.join(command))


def llamacpp_ratios(median: dict[str, float], llamacpp: dict[str, Any]) -> dict[str, float]:
    """pagellm's median tok/s over llama.cpp's mean, per phase: above 1 means pagellm is faster."""
    return dict(prefill=median["prefill_tokens_per_s"] / llamacpp["prefill_tokens_per_s"],
                decode=median["decode_tokens_per_s"] / llamacpp["decode_tokens_per_s"])


def format_llamacpp(report: dict[str, Any]) -> str:
    """The side-by-side table of pagellm and llama.cpp on the same GGUF, with the ratio under it."""
    ours, theirs, ratio = report["median"], report["llamacpp"], report["pagellm_over_llamacpp"]
    rows = [dict(system=name, prefill=tps["prefill_tokens_per_s"], decode=tps["decode_tokens_per_s"])
            for name, tps in (("pagellm (median)", ours), ("llama.cpp (mean)", theirs))]
    columns = [("system", "system", ""), ("prefill", "prefill tok/s", ".1f"), ("decode", "decode tok/s", ".1f")]
    commit = theirs.get("build", {}).get("build_commit")
    build = f" (llama.cpp {commit})" if commit else ""
    return (format_table(rows, columns) +
            f"\npagellm / llama.cpp{build}: prefill {ratio['prefill']:.2f}x, decode {ratio['decode']:.2f}x")


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [dict(run=str(i + 1), **run) for i, run in enumerate(report["runs"])]
    rows.append(dict(run="median", **report["median"]))
    columns = [("run", "run", "s"), ("ttft_s", "TTFT s", ".3f"), ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
               ("decode_tokens_per_s", "decode tok/s", ".1f"), ("decode_s", "decode s", ".2f")]
    plan = " ".join(f"{k}={v}" for k, v in report["kernel_plan"].items())
    text = (f"batch 1: prompt {cfg['input_len']}, {cfg['output_len']} greedy tokens, {cfg['dtype']}\n"
            f"kernel plan: {plan}\nstep routes: {format_routes(report.get('step_routes', {}))}\n"
            + format_table(rows, columns))
    return text + "\n\n" + format_llamacpp(report) if "llamacpp" in report else text
