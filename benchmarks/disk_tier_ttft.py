"""Time to first token of a long prompt whose KV the pool no longer holds (issue 43's targets):
read back from the disk tier (>= 10x faster than computing it again), and on a restarted engine
(>= 10x faster than on a cold one), its greedy answer equal to the cold run's token for token.

    python benchmarks/disk_tier_ttft.py [--model M] [--prompt-len 4000] [--rounds 3] [--output-json FILE]

Each round, on a fresh tier folder, with a KV pool that holds the prompt and its answer
(``--kv-offload-dir``):

1. cold: a new engine, the prompt: its prefill computed (the floor every ratio names);
2. a filler prompt of the same length pushes (almost all of) the prompt's blocks out of the pool;
3. disk: the prompt again, its blocks read back from the tier;
4. pool: the prompt again, its blocks still in the pool (for comparison);
5. restart: the engine closed, a new one on the same folder, the prompt (its first request, as
   the cold one's was: both pay the first forward's one-time costs).

Each time counts from the request to its first token (``LLMEngine`` steps); every answer is 16
greedy tokens, compared with the cold one's. Prints a table and the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import SamplingParams  # noqa: E402
from pagellm.engine.llm_engine import LLMEngine  # noqa: E402
from pagellm.engine_args import EngineArgs  # noqa: E402

ANSWER = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompt_ids(length: int, seed: int) -> dict:
    """``length`` token ids of ordinary vocabulary (the default tokenizer's 300..9000)."""
    return {"prompt_token_ids": [300 + (seed * 7919 + i * 104729) % 8700 for i in range(length)]}


def first_token(engine: LLMEngine, prompt: dict) -> tuple[float, list[int], int]:
    """Seconds to the first token (streamed), the whole answer, and the prompt tokens served from a cache."""
    start = time.perf_counter()
    request_id = engine.new_request_id()
    engine.add_request(request_id, prompt, ANSWER, stream=True)
    ttft, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():  # (streamed: each output holds the new tokens)
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            tokens += out.outputs[0].token_ids
            if out.finished:
                assert ttft is not None
                return ttft, tokens, out.num_cached_tokens
    raise RuntimeError("the request did not finish")


def progress(index: int, what: str, seconds: float) -> None:
    print(f"round {index}: {what} {seconds:.3f} s", file=sys.stderr, flush=True)


def make_engine(args: argparse.Namespace, folder: str) -> LLMEngine:
    options = dict(kv_offload_dir=folder, kv_offload_size=args.tier_size, num_threads=args.threads,
                   num_kv_blocks=(args.prompt_len + 16) // 16 + 4, max_model_len=args.prompt_len + 64)  # fmt: skip
    return LLMEngine(EngineArgs(args.model, **options).create_engine_config())


def one_round(args: argparse.Namespace, index: int) -> dict[str, float]:
    prompt, filler = prompt_ids(args.prompt_len, 2 * index + 1), prompt_ids(args.prompt_len, 2 * index + 2)
    with tempfile.TemporaryDirectory(prefix="pagellm-tier-") as folder:
        engine = make_engine(args, folder)
        cold, answer, _ = first_token(engine, prompt)
        progress(index, "cold", cold)
        progress(index, "filler", first_token(engine, filler)[0])
        disk, disk_answer, disk_cached = first_token(engine, prompt)
        progress(index, "disk", disk)
        pool, pool_answer, _ = first_token(engine, prompt)
        loaded = engine.stats.disk_tier_loaded_blocks
        engine.close()
        del engine
        engine = make_engine(args, folder)
        restart, restart_answer, restart_cached = first_token(engine, prompt)
        progress(index, "restart", restart)
        engine.close()
    if not (answer == disk_answer == pool_answer == restart_answer):
        raise AssertionError(f"answers differ: cold {answer}, disk {disk_answer}, pool {pool_answer}, "
                             f"restart {restart_answer}")  # fmt: skip
    return {"cold_s": cold, "disk_s": disk, "pool_s": pool, "restart_s": restart, "disk_cached_tokens": disk_cached,
            "restart_cached_tokens": restart_cached, "blocks_loaded": loaded}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tier-size", default="8GiB")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rounds = [one_round(args, i) for i in range(args.rounds)]
    print(f"| round | cold s | disk s | pool s | restart s | cold / disk | cold / restart |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, r in enumerate(rounds):
        print(f"| {i} | {r['cold_s']:.3f} | {r['disk_s']:.3f} | {r['pool_s']:.3f} | {r['restart_s']:.3f} | "
              f"{r['cold_s'] / r['disk_s']:.1f}x | {r['cold_s'] / r['restart_s']:.1f}x |")  # fmt: skip
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    medians["cold_over_disk"] = statistics.median(r["cold_s"] / r["disk_s"] for r in rounds)
    medians["cold_over_restart"] = statistics.median(r["cold_s"] / r["restart_s"] for r in rounds)
    result = {"model": args.model or "default", "prompt_len": args.prompt_len, "threads": args.threads,
              "rounds": rounds, "medians": medians, "answers_equal": True}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
