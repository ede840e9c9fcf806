"""``pagellm bench {throughput,latency,memory,sweep,serve}``: argument parsing and the handler.

The product CLI passes ``pagellm bench ...`` to :func:`main`, importing this module only then;
``add_bench_subparser(subparsers)`` wires the same parser into another CLI. Engine options are
``EngineArgs`` fields (:func:`pagellm.engine_args.add_engine_args`), defaulting to None here:
"the engine's default", except the dtype (bfloat16, as the figures in benchmarks/NOTES.md).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from pagellm.benchmarks._common import RESULTS_DIR, write_json
from pagellm.benchmarks.workloads import SERVE_WORKLOADS, WORKLOADS
from pagellm.engine_args import add_engine_args, cli_engine_options


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rate(text: str) -> float:
    return float("inf") if text.lower() in ("inf", "infinity") else float(text)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default=None, help="write the full report as JSON to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bars")


def _add_workload_args(parser: argparse.ArgumentParser, default: str, choices: tuple[str, ...] = WORKLOADS) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=choices, default=default)
    group.add_argument("--num-prompts", type=int, default=None, help="requests (default: the workload's)")
    group.add_argument("--input-len", type=int, default=None, help="fixed: prompt tokens (128)")
    group.add_argument("--output-len", type=int, default=None, help="fixed / shared-prefix: output tokens")
    group.add_argument("--prefix-len", type=int, default=None, help="shared-prefix / multi-turn: shared tokens (512 / 6000)")
    group.add_argument("--suffix-len", type=int, default=None,
                       help="shared-prefix: own tokens (32); multi-turn: each turn's new tokens (300)")
    group.add_argument("--seed", type=int, default=0)


# The engine options each benchmark takes (EngineArgs fields).
_THROUGHPUT_ENGINE = ("model", "dtype", "quantization", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                      "block_size", "kv_cache_dtype", "enable_prefix_caching", "num_threads", "attention_backend",
                      "tensor_parallel_size", "pipeline_parallel_size", "cpu_bind", "speculative_config",
                      "kv_offload_dir", "kv_offload_size", "packed_weights_cache_size")
_LATENCY_ENGINE = ("model", "dtype", "quantization", "num_threads", "kv_cache_dtype", "attention_backend",
                   "speculative_config", "packed_weights_cache_size")


def _add_engine_args(parser: argparse.ArgumentParser, names: tuple[str, ...] = _THROUGHPUT_ENGINE) -> None:
    defaults = dict.fromkeys(names, None) | {"dtype": "bfloat16"}
    add_engine_args(parser, names, defaults, positional_model=False)


def add_bench_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` (with its own subcommands) to a CLI's subparsers; returns its parser."""
    bench = subparsers.add_parser("bench", help="benchmarks: throughput, latency, startup, memory, sweep (plot), serve")
    _fill_bench_parser(bench)
    return bench


def _fill_bench_parser(bench: argparse.ArgumentParser) -> None:
    bench.set_defaults(handler=bench_main)
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline throughput (optionally against HF / vLLM)")
    _add_workload_args(tp, "fixed")
    _add_engine_args(tp)
    tp.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where pagellm (and --compare hf) run (default: cpu)")
    group = tp.add_argument_group("comparison")
    group.add_argument("--compare", action="append", default=[], choices=["hf", "vllm", "json"],
                       help="also run HF static batching / vLLM / pagellm with every request constrained to a "
                            "JSON schema (repeatable)")
    group.add_argument("--hf-batch-sizes", type=_int_list, default=[64], help="e.g. 1,8,64")
    group.add_argument("--hf-max-requests", type=int, default=None,
                       help="run at most this many requests per HF batch size and extrapolate rates")
    group.add_argument("--hf-attn", default="sdpa", help="HF attention implementation (sdpa, eager)")
    group.add_argument("--vllm-python", default=None,
                       help="python of a venv with vLLM's CPU build, for --compare vllm (default: this one)")
    group.add_argument("--vllm-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                       help="vLLM's dtype for --compare vllm (default: pagellm's --dtype), e.g. float32 where "
                            "the CPU has no AVX-512 BF16 and vLLM's bf16 is emulated")
    group.add_argument("--repeats", type=int, default=1, help="run everything N times (interleaved); report medians")
    group.add_argument("--isolation", choices=["process", "none"], default="process",
                       help="one child process per system (default) or everything in this process")
    _add_common(tp)

    lat = sub.add_parser("latency", help="one user at a time (batch 1): prefill and decode tok/s")
    _add_engine_args(lat, _LATENCY_ENGINE)
    lat.add_argument("--input-len", type=int, default=128, help="prompt tokens (128)")
    lat.add_argument("--output-len", type=int, default=256, help="greedy tokens generated (256)")
    lat.add_argument("--repeats", type=int, default=3, help="requests timed, one after another (median reported)")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--workload", choices=["random", "copy", "chat"], default="random",
                     help="random prompt tokens (--input-len); copy: a code passage asked back with one name "
                          "changed (what --speculative-config's n-gram lookup is for); chat: open questions")
    lat_cmp = lat.add_argument_group("comparison")
    lat_cmp.add_argument("--compare", action="append", default=[], choices=["llamacpp", "ik_llama"],
                         help="also run llama.cpp's or ik_llama.cpp's llama-bench on the same GGUF, same threads "
                              "and lengths, alternating with pagellm (repeat the option for both)")
    lat_cmp.add_argument("--llama-bench", default=None, metavar="PATH",
                         help="llama.cpp's llama-bench, for --compare llamacpp (how to build it: docs/llama-bench.md)")
    lat_cmp.add_argument("--llama-bench-args", default=None, metavar="ARGS",
                         help="extra llama-bench arguments for llama.cpp, one string (none by default)")
    lat_cmp.add_argument("--ik-llama-bench", default=None, metavar="PATH",
                         help="ik_llama.cpp's llama-bench, for --compare ik_llama (docs/llama-bench.md)")
    lat_cmp.add_argument("--ik-llama-bench-args", default=None, metavar="ARGS",
                         help="extra llama-bench arguments for ik_llama.cpp, one string (default: '-rtr 1')")
    lat_cmp.add_argument("--no-floor", action="store_true",
                         help="skip the decode floor (read bandwidth and bytes per token: a few seconds)")
    _add_common(lat)

    st = sub.add_parser("startup", help="launch to ready and peak memory of a fresh process (pagellm/benchmarks/startup.py)")
    _add_engine_args(st, ("model", "dtype", "quantization", "num_threads", "kv_cache_memory",
                          "packed_weights_cache_size"))  # fmt: skip
    st.add_argument("--repeats", type=int, default=3, help="fresh processes, one after another (median reported)")
    _add_common(st)

    mem = sub.add_parser("memory", help="paged KV blocks vs contiguous reservation (no model)")
    mem.add_argument("--workload", choices=WORKLOADS, default="mixed")
    mem.add_argument("--num-prompts", type=int, default=None)
    mem.add_argument("--seed", type=int, default=0)
    mem.add_argument("--block-size", type=int, default=16)
    mem.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV budget in token slots")
    mem.add_argument("--max-model-len", type=int, default=2048, help="what the naive baseline reserves")
    mem.add_argument("--max-num-seqs", type=int, default=None)
    mem.add_argument("--naive-oracle", action="store_true", help="also: contiguous, reserving exactly what is used")
    mem.add_argument("--bytes-per-token", type=int, default=None,
                     help="KV bytes per token for MiB columns (default: the default model's, bf16)")
    _add_common(mem)

    sw = sub.add_parser("sweep", help="throughput vs concurrency, plus the memory benchmark, as one PNG")
    sw.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 64])
    sw.add_argument("--input-len", type=int, default=128)
    sw.add_argument("--output-len", type=int, default=128)
    sw.add_argument("--prompts-per-seq", type=int, default=2)
    sw.add_argument("--compare-hf", action="store_true")
    sw.add_argument("--plot", default=str(RESULTS_DIR / "summary.png"), help="PNG to write")
    sw.add_argument("--copy-to", default=None, help="also copy the PNG here (e.g. docs/benchmarks.png)")
    sw.add_argument("--memory-json", default=None, help="use this memory report instead of running it")
    _add_engine_args(sw)
    _add_common(sw)

    sv = sub.add_parser("serve", help="online load against an OpenAI-compatible server")
    _add_workload_args(sv, "fixed", SERVE_WORKLOADS)
    sv.add_argument("--turns", type=int, default=None, help="multi-turn: turns a conversation (4)")
    sv.add_argument("--base-url", default="http://127.0.0.1:8000")
    sv.add_argument("--request-rate", type=_rate, default=float("inf"), help="Poisson arrivals per second (inf)")
    sv.add_argument("--max-concurrency", type=int, default=None)
    sv.add_argument("--served-model", default=None, help="'model' field of the requests")
    sv.add_argument("--temperature", type=float, default=0.0)
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--vocab-size", type=int, default=None,
                    help="draw prompt ids below this (default: the default model's vocabulary)")
    _add_common(sv)


def _emit(report: dict[str, Any], text: str, output_json: str | None) -> None:
    print(text)
    if output_json:
        path = write_json(output_json, report)
        print(f"wrote {path}")


def bench_main(args: argparse.Namespace) -> int:
    command = args.bench_command
    if command == "throughput":
        from pagellm.benchmarks.throughput import ThroughputConfig, format_report, run_throughput

        cfg = ThroughputConfig(
            workload=args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, prefix_len=args.prefix_len, suffix_len=args.suffix_len, seed=args.seed,
            engine=cli_engine_options(args, (*_THROUGHPUT_ENGINE, "device")), compare=list(dict.fromkeys(args.compare)),
            hf_batch_sizes=args.hf_batch_sizes, hf_max_requests=args.hf_max_requests, hf_attn=args.hf_attn,
            vllm_python=args.vllm_python, vllm_dtype=args.vllm_dtype,
            repeats=args.repeats, isolation=args.isolation, progress=args.progress,
        )
        report = run_throughput(cfg)
        _emit(report, format_report(report), args.output_json)
        return 0
    if command == "latency":
        from pagellm.benchmarks.latency import LatencyConfig, format_report, run_latency

        report = run_latency(LatencyConfig(
            engine=cli_engine_options(args, _LATENCY_ENGINE), input_len=args.input_len,
            output_len=args.output_len, repeats=args.repeats, seed=args.seed,
            compare=list(dict.fromkeys(args.compare)),
            peer_binaries={name: path for name, path in (("llamacpp", args.llama_bench),
                                                         ("ik_llama", args.ik_llama_bench)) if path},
            peer_args={name: shlex.split(text) for name, text in (("llamacpp", args.llama_bench_args),
                                                                  ("ik_llama", args.ik_llama_bench_args)) if text is not None},
            floor=not args.no_floor, workload=args.workload,
        ))
        _emit(report, format_report(report), args.output_json)
        return 0
    if command == "startup":
        from pagellm.benchmarks.startup import StartupConfig, format_report, run_startup

        options = cli_engine_options(args, ("dtype", "quantization", "num_threads", "kv_cache_memory",
                                            "packed_weights_cache_size"))  # fmt: skip
        report = run_startup(StartupConfig(model=args.model, engine=options, repeats=args.repeats))
        _emit(report, format_report(report), args.output_json)
        return 0
    if command == "memory":
        from pagellm.benchmarks.memory import MemoryConfig, format_report, run_memory

        cfg = MemoryConfig(
            workload=args.workload, num_prompts=args.num_prompts, seed=args.seed, block_size=args.block_size,
            kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            naive_oracle=args.naive_oracle, bytes_per_token=args.bytes_per_token,
        )
        report = run_memory(cfg)
        _emit(report, format_report(report), args.output_json)
        return 0
    if command == "sweep":
        return _sweep(args)
    if command == "serve":
        from pagellm.benchmarks.serve import format_report, run_serve
        from pagellm.benchmarks.workloads import make_workload

        if args.vocab_size is not None:
            vocab_size, special = args.vocab_size, frozenset()
        else:
            from pagellm.benchmarks._common import model_token_facts

            vocab_size, special = model_token_facts(None)
        workload = make_workload(
            args.workload, vocab_size, num_prompts=args.num_prompts, seed=args.seed, special_ids=special,
            input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len, suffix_len=args.suffix_len,
            turns=args.turns,
        )
        report = run_serve(
            workload, base_url=args.base_url, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
            model=args.served_model, temperature=args.temperature, api_key=args.api_key, seed=args.seed,
            progress=args.progress,
        )
        _emit(report, format_report(report), args.output_json)
        return 0 if report["summary"]["failed"] == 0 else 1
    raise SystemExit(f"unknown bench command {command!r}")


def _sweep(args: argparse.Namespace) -> int:
    import json

    from pagellm.benchmarks.memory import MemoryConfig, run_memory
    from pagellm.benchmarks.memory import format_report as format_memory
    from pagellm.benchmarks.plot import format_sweep, plot_summary, run_sweep

    engine = {k: v for k, v in cli_engine_options(args, _THROUGHPUT_ENGINE).items()
              if k not in ("model", "dtype", "max_num_seqs")}  # fmt: skip  (the sweep sets those itself)
    sweep = run_sweep(
        args.concurrency, model=args.model, dtype=args.dtype, input_len=args.input_len, output_len=args.output_len,
        prompts_per_seq=args.prompts_per_seq, compare_hf=args.compare_hf, engine_options=engine,
        progress=args.progress,
    )
    print(format_sweep(sweep))
    if args.memory_json:
        memory = json.loads(Path(args.memory_json).read_text())
    else:
        memory = run_memory(MemoryConfig())
        print(format_memory(memory))
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    title = f"pagellm on {sweep['machine']['cpu']} ({sweep['machine']['cpu_count']} cores), {time.strftime('%Y-%m-%d')}"
    plot_summary(sweep, memory, args.plot, title)
    print(f"wrote {args.plot}")
    if args.copy_to:
        Path(args.copy_to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.plot, args.copy_to)
        print(f"copied to {args.copy_to}")
    if args.output_json:
        write_json(args.output_json, dict(sweep=sweep, memory=memory))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m pagellm.benchmarks") -> int:
    """``pagellm bench ...`` (the product CLI hands its arguments here) and ``python -m pagellm.benchmarks``."""
    parser = argparse.ArgumentParser(prog=prog, description="pagellm benchmarks")
    _fill_bench_parser(parser)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
