"""``pagellm bench latency``: one user at a time (batch 1), prefill and decode tokens per second.

One request of ``input_len`` random prompt tokens generates ``output_len`` greedy tokens (EOS
ignored), ``repeats`` times, each with a fresh prompt (no prefix-cache hits). Prefill tok/s is
``input_len`` over the time to the first token; decode tok/s is the other ``output_len - 1``
tokens over the time after it. The engine is stepped directly, so the figures include the
scheduler, the output processing and detokenization, as a user of ``LLM`` sees them; the kernel
plan is in the report. What single-user latency targets (issue P3) are measured with.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from pagellm.benchmarks._common import format_table, machine_info, model_token_facts, peak_rss_mib
from pagellm.benchmarks.workloads import fixed_workload


@dataclass
class LatencyConfig:
    model: str | None = None
    dtype: str = "bfloat16"
    input_len: int = 128
    output_len: int = 256
    repeats: int = 3
    seed: int = 0
    num_threads: int | None = None
    kv_cache_dtype: str | None = None
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 2 or self.repeats < 1:
            raise ValueError("latency needs input_len >= 1, output_len >= 2 and repeats >= 1")


def _time_one(engine: Any, request_id: str, prompt: list[int], output_len: int) -> dict[str, float]:
    """Run one request alone; seconds to the first token and for the rest."""
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    engine.add_tokenized_request(request_id, None, prompt, params, stream=True)
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
    """Build the engine once, warm it up, then time ``repeats`` single requests."""
    from pagellm import LLM

    options = dict(dtype=cfg.dtype, max_num_seqs=1, enable_prefix_caching=False, num_threads=cfg.num_threads,
                   kv_cache_dtype=cfg.kv_cache_dtype, attention_backend=cfg.attention_backend)
    llm = LLM(cfg.model, **{k: v for k, v in options.items() if v is not None})
    engine = llm.llm_engine
    vocab_size, special = model_token_facts(cfg.model)
    prompts = fixed_workload(vocab_size, cfg.repeats + 1, cfg.input_len, cfg.output_len, cfg.seed, special)
    _time_one(engine, "warmup", prompts.requests[0].prompt_token_ids[:16], 4)
    runs = [_time_one(engine, f"latency-{i}", r.prompt_token_ids, cfg.output_len)
            for i, r in enumerate(prompts.requests[1:])]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return dict(config=asdict(cfg), machine=machine_info(), kernel_plan=engine.kernel_plan_info, runs=runs,
                median=medians, peak_rss_mib=peak_rss_mib())


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [dict(run=str(i + 1), **run) for i, run in enumerate(report["runs"])]
    rows.append(dict(run="median", **report["median"]))
    columns = [("run", "run", "s"), ("ttft_s", "TTFT s", ".3f"), ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
               ("decode_tokens_per_s", "decode tok/s", ".1f"), ("decode_s", "decode s", ".2f")]
    plan = " ".join(f"{k}={v}" for k, v in report["kernel_plan"].items())
    return (f"batch 1: prompt {cfg['input_len']}, {cfg['output_len']} greedy tokens, {cfg['dtype']}\n"
            f"kernel plan: {plan}\n" + format_table(rows, columns))
