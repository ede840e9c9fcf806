"""Speculative decoding on a hybrid model at a real size: what verifying drafts costs where the
recurrent state must be kept from before them and put back on a rejection
(docs/speculative-decoding.md).

    python benchmarks/hybrid_speculation.py --model q35.gguf [--k 3] [--right 3,2,1,0] \
        [--output-len 64] [--rounds 3] [--json out.json]

Random weights accept no real drafts, so the drafts here come from an oracle: the model's own
greedy answer (from a plain run first), of which each step's drafts take the next ``right``
tokens and then wrong ones up to ``k``. ``right = k`` accepts every draft (one step yields k + 1
tokens); below it, every verifying step rejects one and is followed by a step computing the
accepted tokens again. For each ``right``, the plain engine and the speculating one decode the
same prompt in alternating rounds: decode tokens a second (prefill subtracted: a 1-token run of
each), the ratio, and whether the output equals plain decoding's (it must). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagellm import LLM, SamplingParams


class Oracle:
    """Drafts the answer's next ``right`` tokens, then wrong ones up to the limit."""

    def __init__(self, prompt: list[int], answer: list[int], right: int) -> None:
        self.prompt, self.answer, self.right = prompt, answer, right

    def propose(self, seq_id: str, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - len(self.prompt)
        right = self.answer[done : done + min(self.right, limit)]
        return right + [(t + 1) % 1000 + 1 for t in self.answer[done + len(right) : done + limit]]

    def remove(self, seq_ids) -> None:
        pass


def decode_rate(llm: LLM, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """Decode tokens a second (a 1-token run's time subtracted) and the output."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
    prefill = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    return (output_len - 1) / (time.perf_counter() - start - prefill), list(out)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run both speculation benchmarks take."""
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--json", default=None)


def engine_options(args: argparse.Namespace) -> dict:
    """One sequence at a time, no prefix cache: each round computes its prompt."""
    return dict(num_threads=args.num_threads, kv_cache_memory="1GiB", max_num_seqs=4, enable_prefix_caching=False)


def write_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    """The table's rows as JSON (``--json``)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "input_len": args.input_len, "output_len": args.output_len, "rows": rows}, f,
                      indent=1)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a hybrid model (GGUF file or folder)")
    parser.add_argument("--k", type=int, default=3, help="drafts a step")
    parser.add_argument("--right", default="3,2,1,0", help="right drafts a step, comma-separated")
    add_run_arguments(parser)
    args = parser.parse_args()
    options = engine_options(args)
    plain = LLM(args.model, **options)
    spec = LLM(args.model, **options, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "disable_by_batch_size": None, "adaptive": False})  # fmt: skip
    prompt = [(7 * i) % 20000 + 100 for i in range(args.input_len)]
    _, answer = decode_rate(plain, prompt, args.output_len + args.k + 1)
    rows = []
    for right in (int(r) for r in args.right.split(",")):
        spec.llm_engine.scheduler.speculator.proposer = Oracle(prompt, answer, right)
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        equal = True
        for _ in range(args.rounds):
            for name, llm in (("plain", plain), ("spec", spec)):
                rate, out = decode_rate(llm, prompt, args.output_len)
                rates[name].append(rate)
                equal &= out == answer[: args.output_len]
        row = {"right": right, "k": args.k, "plain": statistics.median(rates["plain"]),
               "spec": statistics.median(rates["spec"]), "equal": equal, "rounds": rates}  # fmt: skip
        row["ratio"] = row["spec"] / row["plain"]
        rows.append(row)
        print(f"right {right}/{args.k}: decode tok/s plain {row['plain']:.1f}, speculating {row['spec']:.1f} "
              f"({row['ratio']:.2f}x), output equal: {equal}", flush=True)  # fmt: skip
    write_rows(args, rows)


if __name__ == "__main__":
    main()
