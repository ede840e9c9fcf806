"""Speculative decoding with the model's own MTP layer (speculative method "mtp") at a real size:
what the layer and its verification steps cost, and what they give at a given acceptance
(docs/speculative-decoding.md).

    python -m pagellm.benchmarks.random_model DIR --shape mla-1b --mtp   # (or qwen3.5-0.8b)
    python benchmarks/mtp_speculation.py --model DIR [--k 1,3] [--right 0,1,3] \
        [--output-len 64] [--rounds 3] [--json out.json]

A random-weight layer's drafts are all rejected, so each configuration runs twice: as it is
(``right`` "none": the cost of speculating for nothing, and with ``adaptive`` on, of having the
layer configured at all), and with an oracle that, after the layer has run (its cost paid),
replaces each step's first ``right`` drafts by the model's own greedy answer and the rest by
wrong tokens. For each row the plain engine and the speculating one decode the same prompt in
alternating rounds: decode tokens a second (prefill subtracted: a 1-token run of each), the
ratio, and whether the output equals plain decoding's (it must). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics

from hybrid_speculation import add_run_arguments, decode_rate, engine_options, write_rows  # (this folder's: the same runs)

from pagellm import LLM


class OracleDrafts:
    """The MTP source's drafts after it ran: the answer's next ``right`` tokens of each step, then
    wrong ones (None: its own drafts)."""

    def __init__(self, source, prompt: list[int], answer: list[int], right: int | None) -> None:
        self.source, self.prompt, self.answer, self.right = source, prompt, answer, right
        self.step_start = 0  # the position of the step's first draft

    def first(self, batch, rows, known, masks, output):  # type: ignore[no-untyped-def]
        tokens = self.source.first(batch, rows, known, masks, output)
        self.step_start = int(known[0])
        return [self._token(self.step_start) if t is not None else None for t in tokens]

    def next(self, batch, rows, live, last, masks):  # type: ignore[no-untyped-def]
        self.source.next(batch, rows, live, last, masks)
        return [self._token(int(position) + 1) for position in last]

    def _token(self, position: int) -> int:
        index = position - len(self.prompt)
        right = self.right is not None and position - self.step_start < self.right and index < len(self.answer)
        return self.answer[index] if right else (self.answer[index % len(self.answer)] + 1) % 1000 + 1

    def __getattr__(self, name: str):  # (observe, finish, after_target, kv_cache: the source's)
        return getattr(self.source, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a folder with an MTP layer (random_model --mtp)")
    parser.add_argument("--k", default="1,3", help="drafts a step, comma-separated")
    parser.add_argument("--right", default="none,0,1,3", help="right drafts a step (none: the layer's own)")
    add_run_arguments(parser)
    args = parser.parse_args()
    options = engine_options(args)
    plain = LLM(args.model, **options)
    prompt = [(7 * i) % 20000 + 100 for i in range(args.input_len)]
    _, answer = decode_rate(plain, prompt, args.output_len + 20)
    engines = {"adaptive": LLM(args.model, **options, speculative_config={"method": "mtp", "num_speculative_tokens": 1})}
    for k in (int(k) for k in args.k.split(",")):
        engines[f"k={k}"] = LLM(args.model, **options, speculative_config={
            "method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None, "adaptive": False})  # fmt: skip
    rows = []
    for name, spec in engines.items():
        drafter = spec.llm_engine.executor.model_runner.drafter
        source = drafter.source
        k = spec.llm_engine.scheduler.speculator.config.num_speculative_tokens
        for right in args.right.split(","):
            if name == "adaptive" and right != "none":
                continue
            drafter.source = OracleDrafts(source, prompt, answer, None if right == "none" else int(right))
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            equal, before = True, spec.llm_engine.scheduler.speculator.stats.num_draft_tokens
            for _ in range(args.rounds):
                for label, llm in (("plain", plain), ("spec", spec)):
                    rate, out = decode_rate(llm, prompt, args.output_len)
                    rates[label].append(rate)
                    equal &= out == answer[: args.output_len]
            drafted = spec.llm_engine.scheduler.speculator.stats.num_draft_tokens - before
            row = {"engine": name, "k": k, "right": right, "plain": statistics.median(rates["plain"]),
                   "spec": statistics.median(rates["spec"]), "equal": equal, "drafts": drafted, "rounds": rates}  # fmt: skip
            row["ratio"] = row["spec"] / row["plain"]
            rows.append(row)
            print(f"{name:9s} right {right:>4s}: decode tok/s plain {row['plain']:.1f}, with mtp {row['spec']:.1f} "
                  f"({row['ratio']:.2f}x), {drafted} drafts, output equal: {equal}", flush=True)  # fmt: skip
            drafter.source = source
    write_rows(args, rows)


if __name__ == "__main__":
    main()
