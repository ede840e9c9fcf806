"""Bytes one engine step sends from the scheduler to the worker ranks (issue 34's target).

Drives the real scheduler (``core/``: tensor-free, so no model runs) with ``--num-seqs``
requests of ``--context``-token prompts until every one decodes, then encodes one decode step's
``SchedulerOutput`` through ``step_codec``: the one encoding every other rank receives (local
ranks over ``MultiprocExecutor``'s pipes, remote nodes, Ray actors). Steps are diffs of the
worker's input batch, so this also reports the step that first sends the sequences whole. Prints
a table and writes JSON. Issue 34's "before" (whole sequences every step, pickled to local ranks)
is in ``NOTES.md``: 430,236 B per other local rank for 64 x 2048.

    python benchmarks/step_message_bytes.py [--num-seqs 64] [--context 2048] [--tp 3] [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sequence import Sequence
from pagellm.core.scheduler import Scheduler
from pagellm.sampling_params import SamplingParams
from pagellm.step import ModelRunnerOutput, SchedulerOutput
from pagellm.step_codec import decode_step as decode_message
from pagellm.step_codec import encode_step


def decode_step(num_seqs: int, context: int, block_size: int, budget: int) -> tuple[SchedulerOutput, int]:
    """A decode step of ``num_seqs`` sequences whose contexts are ``context`` tokens long, and the
    bytes of all the steps before it (those that sent the prompts)."""
    # Each sequence decodes until the last one's prompt is in: as many tokens as there are prompts.
    max_tokens = num_seqs + 8
    blocks_each = -(-(context + max_tokens) // block_size)
    manager = KVCacheManager(num_seqs * blocks_each + 8, block_size, enable_caching=True)
    scheduler = Scheduler(manager, num_seqs, budget, context + max_tokens)
    for i in range(num_seqs):  # distinct prompts: no prefix-cache sharing shrinks the tables
        prompt = [1000 + i] + [(7 * i + j) % 30000 + 1 for j in range(context - 2)]
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
        scheduler.add_sequence(Sequence(f"req-{i}", prompt, params, max_tokens=max_tokens, eos_token_ids=frozenset({2})))
    before = 0
    while True:
        out = scheduler.schedule()
        if out.scheduled and all(r.num_tokens == 1 for r in out.scheduled) and len(out.scheduled) == num_seqs:
            return out, before
        before += len(encode_step(out, None))
        sampled = {r.seq_id: 5 for r in out.scheduled if r.sample}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))


def integers_in(step: SchedulerOutput) -> int:
    """Token ids and block ids the message carries."""
    return sum(len(r.new_token_ids) + len(r.new_block_ids) for r in step.scheduled) + sum(
        len(n.token_ids) for n in step.new_sequences
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=3, help="tensor-parallel ranks (rank 0 is the engine's process)")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    step, prompts_bytes = decode_step(args.num_seqs, args.context, args.block_size, args.max_num_batched_tokens)
    codec = len(encode_step(step, None))
    start = time.perf_counter()
    for _ in range(50):
        decode_message(encode_step(step, None))
    codec_ms = (time.perf_counter() - start) / 50 * 1e3
    row = {
        "num_seqs": args.num_seqs, "context": args.context, "tp": args.tp, "integers": integers_in(step),
        "bytes_per_rank": codec, "bytes_per_step": codec * (args.tp - 1), "prefill_steps_bytes_per_rank": prompts_bytes,
        "scheduled_tokens": step.num_scheduled_tokens, "encode_decode_ms": codec_ms,
    }  # fmt: skip
    print("| sequences x context | integers | B per other rank | B per step at TP | encode + decode ms "
          "| B of the steps that sent the prompts, per rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {args.num_seqs} x {args.context} | {row['integers']:,} | {codec:,} | {codec * (args.tp - 1):,} "
          f"(TP={args.tp}) | {codec_ms:.3f} | {prompts_bytes:,} |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
