"""``pagellm bench latency``: one user at a time (batch 1), prefill and decode tokens per second.

One request of ``input_len`` random prompt tokens generates ``output_len`` greedy tokens (EOS
ignored), ``repeats`` times, each with a fresh prompt (no prefix-cache hits). The ``copy``
workload instead asks for a code passage back with one name changed (``text_workloads.py``: the
prompt's own length), where speculative decoding (``--speculative-config``) finds most of the
answer in the prompt, and ``chat`` asks open questions, with little to copy; the report then has
the drafts' acceptance. Prefill tok/s is
``input_len`` over the time to the first token; decode tok/s is the other ``output_len - 1``
tokens over the time after it. The engine is stepped directly, so the figures include the
scheduler, the output processing and detokenization, as a user of ``LLM`` sees them; the kernel
plan is in the report. What single-user latency targets (issue P3) are measured with.

The report has the decode floor (``benchmarks.floor``): the read bandwidth measured with the
kernels' loads, the bytes a pagellm decode token reads and (GGUF) the bytes the file's tensors
hold, and the fraction of the floor each engine reaches.

With ``compare=["llamacpp", "ik_llama"]`` the same GGUF file is also run through each peer's
``llama-bench`` (``benchmarks.llama_bench``), one repetition after each of pagellm's repeats;
the report gains each peer's median and pagellm-over-peer ratios.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from pagellm.benchmarks import llama_bench
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
from pagellm.benchmarks.text_workloads import TEXT_WORKLOADS
from pagellm.benchmarks.floor import DecodeFloor, measure_floor
from pagellm.core.speculation import SpeculationStats
from pagellm.benchmarks.workloads import fixed_workload

COMPARE_CHOICES = tuple(llama_bench.PEERS)
LATENCY_WORKLOADS = ("random", *TEXT_WORKLOADS)


@dataclass
class LatencyConfig:
    engine: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields (the rest: the engine's defaults)
    input_len: int = 128
    output_len: int = 256
    repeats: int = 3
    seed: int = 0  # the prompts'
    compare: list[str] = field(default_factory=list)  # peers (llama_bench.PEERS) run on the same GGUF
    peer_binaries: dict[str, str] = field(default_factory=dict)  # peer -> its llama-bench executable
    peer_args: dict[str, list[str]] = field(default_factory=dict)  # peer -> extra arguments (else its defaults)
    floor: bool = True  # measure the read bandwidth and the bytes per token (a few seconds)
    workload: str = "random"  # LATENCY_WORKLOADS

    def __post_init__(self) -> None:
        self.engine = bench_engine_options(self.engine)
        if self.workload not in LATENCY_WORKLOADS:
            raise ValueError(f"unknown latency workload {self.workload!r}; choose from {list(LATENCY_WORKLOADS)}")
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
    """Build the engine once, warm it up, then time ``repeats`` single requests, each followed by
    one run of every peer; then the decode floor."""
    from pagellm import LLM

    # Checked first, so a missing binary or a non-GGUF model fails before minutes of pagellm timing.
    peers = _peers(cfg)
    llm = LLM(**(cfg.engine | dict(max_num_seqs=1, enable_prefix_caching=False)))
    engine = llm.llm_engine
    prompts = _prompts(cfg, llm)
    _time_one(engine, "warmup", prompts[0][:16], 4)
    routes_before = dict(engine.stats.step_routes)
    spec_before = _speculation(engine)
    runs: list[dict[str, float]] = []
    peer_runs: dict[str, list[dict[str, Any]]] = {name: [] for name in peers}
    for i, prompt in enumerate(prompts[1:]):
        runs.append(_time_one(engine, f"latency-{i}", prompt, cfg.output_len))
        for name, (binary, path, extra) in peers.items():  # the idle engine only holds memory
            commands = llama_bench.bench_commands(llama_bench.PEERS[name], binary, path, len(prompt), cfg.output_len,
                                                  _pagellm_threads(cfg), 1, extra)  # fmt: skip
            peer_runs[name].append(dict(llama_bench.run_llama_bench(commands), extra_args=list(extra)))
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    report = dict(config=flat_config(cfg), machine=machine_info(), kernel_plan=engine.kernel_plan_info, runs=runs,
                  median=medians, peak_rss_mib=peak_rss_mib(), prompt_tokens=[len(p) for p in prompts[1:]],
                  step_routes=routes_since(routes_before, engine.stats.step_routes))  # fmt: skip
    if spec_before is not None:
        report["speculation"] = _acceptance(spec_before, _speculation(engine))
    if peer_runs:
        report["peers"] = {name: llama_bench.combine_runs(found) for name, found in peer_runs.items()}
        report["pagellm_over"] = {name: llama_bench.ratios(medians, peer) for name, peer in report["peers"].items()}
    if cfg.floor:
        report["floor"] = floor_report(_floor(cfg, engine), report)
    return report


def _prompts(cfg: LatencyConfig, llm: Any) -> list[list[int]]:
    """The warm-up prompt, then one per repeat."""
    if cfg.workload in TEXT_WORKLOADS:
        return TEXT_WORKLOADS[cfg.workload](llm.get_tokenizer(), cfg.repeats + 1)
    vocab_size, special = model_token_facts(cfg.model)
    workload = fixed_workload(vocab_size, cfg.repeats + 1, cfg.input_len, cfg.output_len, cfg.seed, special)
    return [r.prompt_token_ids for r in workload.requests]


def _speculation(engine: Any) -> tuple[int, int, int] | None:
    """(verifying steps, draft tokens, accepted ones) so far, or None without speculation."""
    stats = engine.stats
    if engine.config.speculative is None:
        return None
    return stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def _acceptance(before: tuple[int, int, int], after: tuple[int, int, int] | None) -> dict[str, float]:
    """The timed runs' drafts: how many, the share accepted, tokens a verifying step produced."""
    assert after is not None
    timed = SpeculationStats(*(a - b for a, b in zip(after, before)))
    return dict(verifying_steps=timed.num_drafts, draft_tokens=timed.num_draft_tokens,
                accepted_tokens=timed.num_accepted_tokens, acceptance_rate=timed.acceptance_rate,
                mean_accepted_length=timed.mean_accepted_length)  # fmt: skip


def _peers(cfg: LatencyConfig) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Each compared peer's (llama-bench, GGUF file, extra arguments), checked now."""
    if not cfg.compare:
        return {}
    binaries = {name: llama_bench.peer_binary(llama_bench.PEERS[name], cfg.peer_binaries.get(name)) for name in cfg.compare}
    path = llama_bench.gguf_model_path(cfg.model)
    return {name: (binary, path, tuple(cfg.peer_args.get(name, llama_bench.PEERS[name].default_args)))
            for name, binary in binaries.items()}  # fmt: skip


def _floor(cfg: LatencyConfig, engine: Any) -> DecodeFloor:
    """The decode floor of this run: its model, K/V dtype, mean context and threads."""
    from pagellm.model.loader import resolve_model_path

    executor = engine.executor
    runner = executor.model_runner
    if runner is None:
        raise RuntimeError("the decode floor needs the model in this process (not a Ray actor)")
    lib = runner.kernel_plan.kernels if runner.kernel_plan.device == "cpu" else None
    path = resolve_model_path(cfg.model)
    mean_context = cfg.input_len + cfg.output_len / 2
    return measure_floor(runner.model, executor.arch, executor.kv_cache_dtype, mean_context, _pagellm_threads(cfg),
                         lib, path if path.endswith(".gguf") else None)  # fmt: skip


def floor_report(floor: DecodeFloor, report: dict[str, Any]) -> dict[str, Any]:
    """The floor's facts, the floor that counts (the file's bytes, else pagellm's; never below
    the best decode rate any engine reached here) and each engine's fraction of it."""
    rates = {"pagellm": report["median"]["decode_tokens_per_s"]}
    rates |= {name: peer["decode_tokens_per_s"] for name, peer in report.get("peers", {}).items()}
    computed = floor.file_floor if floor.file_floor is not None else floor.pagellm_floor
    counts = max(computed, *rates.values())
    return dict(floor.as_dict(), floor_tokens_per_s=counts,
                fraction_of_floor={name: rate / counts for name, rate in rates.items()})


def _pagellm_threads(cfg: LatencyConfig) -> int:
    """The thread count pagellm ran with (the engine has set torch's by now), for llama-bench ``-t``."""
    import torch

    return cfg.num_threads or torch.get_num_threads()


def format_peers(report: dict[str, Any]) -> str:
    """pagellm and each peer on the same GGUF side by side, the ratios under the table."""
    rows = [dict(system="pagellm", **report["median"])]
    rows += [dict(system=llama_bench.PEERS[name].label, **peer) for name, peer in report["peers"].items()]
    columns = [("system", "system (median)", ""), ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
               ("decode_tokens_per_s", "decode tok/s", ".1f")]
    lines = [format_table(rows, columns)]
    for name, ratio in report["pagellm_over"].items():
        peer = report["peers"][name]
        facts = [peer.get("build", {}).get("build_commit", "build unknown"), " ".join(peer["extra_args"]) or "default arguments"]
        lines.append(f"pagellm / {llama_bench.PEERS[name].label} ({', '.join(facts)}): "
                     f"prefill {ratio['prefill']:.2f}x, decode {ratio['decode']:.2f}x")
    return "\n".join(lines)


def format_floor(floor: dict[str, Any]) -> str:
    """Bytes a decode token reads, the bandwidth, the floor and each engine's share of it."""
    mb = 1e6
    lines = [f"decode floor: read {floor['read_gb_per_s']:.1f} GB/s ({floor['bandwidth_source']}); "
             f"K/V {floor['kv_bytes'] / mb:.1f} MB a token"]
    lines.append(f"  pagellm reads {floor['pagellm_bytes'] / mb:.1f} MB of weights a token "
                 f"(floor {floor['pagellm_floor_tokens_per_s']:.1f} tok/s)")
    if floor["file_bytes"] is not None:
        extra = floor["pagellm_bytes"] / floor["file_bytes"] - 1
        lines.append(f"  the file's tensors hold {floor['file_bytes'] / mb:.1f} MB a token "
                     f"(floor {floor['file_floor_tokens_per_s']:.1f} tok/s); pagellm reads {extra:+.1%}")
    shares = ", ".join(f"{llama_bench.PEERS[name].label if name in llama_bench.PEERS else name} {share:.0%}"
                       for name, share in floor["fraction_of_floor"].items())  # fmt: skip
    lines.append(f"  of the floor ({floor['floor_tokens_per_s']:.1f} tok/s): {shares}")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [dict(run=str(i + 1), **run) for i, run in enumerate(report["runs"])]
    rows.append(dict(run="median", **report["median"]))
    columns = [("run", "run", "s"), ("ttft_s", "TTFT s", ".3f"), ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
               ("decode_tokens_per_s", "decode tok/s", ".1f"), ("decode_s", "decode s", ".2f")]
    plan = " ".join(f"{k}={v}" for k, v in report["kernel_plan"].items())
    lengths = report.get("prompt_tokens") or [cfg["input_len"]]
    prompt = f"{cfg.get('workload', 'random')} prompts of {min(lengths)}-{max(lengths)} tokens"
    parts = [f"batch 1: {prompt}, {cfg['output_len']} greedy tokens, {cfg['dtype']}\n"
             f"kernel plan: {plan}\nstep routes: {format_routes(report.get('step_routes', {}))}\n"
             + format_table(rows, columns)]
    if "speculation" in report:
        spec = report["speculation"]
        parts.append(f"speculation: {spec['draft_tokens']} draft tokens in {spec['verifying_steps']} verifying steps, "
                     f"{spec['acceptance_rate']:.0%} accepted, {spec['mean_accepted_length']:.2f} tokens a verifying step")
    if "peers" in report:
        parts.append(format_peers(report))
    if "floor" in report:
        parts.append(format_floor(report["floor"]))
    return "\n\n".join(parts)
