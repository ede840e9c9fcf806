"""Where an engine step's time goes on CPU: each kernel call and linear layer timed in the engine.

    python benchmarks/step_profile.py [--model M] [--batch 64] [--input-len 128] [--output-len 128]
                                      [--kv-cache-dtype auto|fp8|int8]

Runs the ``fixed`` workload's shapes (``--batch`` requests of ``--input-len`` random prompt
tokens, ``--output-len`` greedy tokens, EOS ignored) through ``LLMEngine`` with every
``pagellm.kernels`` call and every linear layer's forward wrapped in a wall-clock timer, and
prints milliseconds per part for the steps that compute prompt tokens ("prefill": their sum),
for the pure decode steps (their sum and the median step), and the part of a step outside
the timed calls ("rest": Python, scheduler, sampler, output processing). The timers add a few
microseconds per call (~300 calls a step): compare splits, not totals, with an untimed run.
Used for the per-step figures in benchmarks/NOTES.md; A/B two builds by running it on each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.engine.protocol import EngineRequest  # noqa: E402
from pagellm.kernels import KernelLibrary  # noqa: E402
from pagellm.worker.worker import Worker  # noqa: E402

KERNELS = ("decoder_stack", "paged_attention", "write_kv", "add_rms_norm", "rotary_", "argmax_rows")
_times: defaultdict[str, float] = defaultdict(float)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _times[name] += time.perf_counter() - start

    return wrapper


def instrument(model: nn.Module, lib: KernelLibrary | None) -> None:
    """Wrap the plan's kernel library's entry points and each linear's forward (grouped by its name)."""
    for name in KERNELS if lib is not None else ():
        setattr(lib, name, _timed(name, getattr(lib, name)))
    for module_name, module in model.named_modules():
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf.endswith("_proj") or leaf == "lm_head":
            module.forward = _timed(leaf, module.forward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 or int8")
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, enable_prefix_caching=False,
              num_threads=args.num_threads, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    worker = engine.executor  # one process: the executor is the worker itself
    assert isinstance(worker, Worker), "step_profile runs one process (no tensor or pipeline parallelism)"
    instrument(worker.model_runner.model, worker.kernel_plan.kernels)
    print(f"kernel plan: {worker.kernel_plan.describe()}")
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = worker.arch.vocab_size
    for i in range(args.batch):
        ids = torch.randint(3, vocab, (args.input_len,), generator=g).tolist()
        engine.add_engine_request(EngineRequest(f"r{i}", ids, params, stream=False))

    prefill: list[dict[str, float]] = []
    decode: list[dict[str, float]] = []
    step_shape: list[tuple[int, int]] = []  # (tokens, requests) of the step being run
    execute = worker.model_runner.execute

    def counting_execute(scheduler_output: Any, *rest: Any) -> Any:
        scheduled = scheduler_output.scheduled
        step_shape.append((sum(r.num_tokens for r in scheduled), len(scheduled)))
        return execute(scheduler_output, *rest)

    worker.model_runner.execute = counting_execute
    while engine.has_unfinished_requests():
        _times.clear()
        step_shape.clear()
        start = time.perf_counter()
        engine.step()
        prefilling = any(tokens > requests for tokens, requests in step_shape)
        split = {k: v * 1e3 for k, v in _times.items()}
        split["step"] = (time.perf_counter() - start) * 1e3
        (prefill if prefilling else decode).append(split)

    print(f"{args.batch} x {args.input_len}/{args.output_len}, {torch.get_num_threads()} threads, ms")
    print(f"{'part':<16} {'prefill (sum)':>14} {'decode (sum)':>13} {'decode (median)':>16}")
    names = sorted({k for s in prefill + decode for k in s} - {"step"})
    for name in [*names, "rest", "step"]:
        print(f"{name:<16} {_total(prefill, name):>14.1f} {_total(decode, name):>13.1f} {_median(decode, name):>16.2f}")
    print(f"{len(prefill)} prefill steps, {len(decode)} decode steps")


def _value(split: dict[str, float], name: str) -> float:
    if name == "rest":
        return split["step"] - sum(v for k, v in split.items() if k != "step")
    return split.get(name, 0.0)


def _total(splits: list[dict[str, float]], name: str) -> float:
    return sum(_value(s, name) for s in splits)


def _median(splits: list[dict[str, float]], name: str) -> float:
    return statistics.median(_value(s, name) for s in splits) if splits else 0.0


if __name__ == "__main__":
    main()
