"""A chat's next turn with a draft model: how long the second request takes when its prompt is
the first one's prompt and answer and then new tokens (docs/speculative-decoding.md).

    python benchmarks/draft_next_turn.py [--model F] [--prompt-tokens 1500] [--rounds 3]

The model (default: the default GGUF) is served dequantized (``quantization="none"``) and drafts
for itself with its own blocks on the integer GEMM (``"quantization": "gguf"``), 3 drafts a step,
greedy, 64 tokens a turn. Each round's first turn is a new prompt (token ids, no tokenizer); the
second turn is timed: the target reads the shared prefix from the prefix cache, and the draft
catches up from the blocks whose draft K/V the first turn left complete. Prints each round's
second-turn seconds and the median. Run it on two trees (``PYTHONPATH=TREE``, from a folder
outside both) to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagellm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, quantization="none", num_threads=args.num_threads, kv_cache_memory="1GiB",
              speculative_config={"method": "draft_model", "quantization": "gguf", "num_speculative_tokens": 3})  # fmt: skip
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    seconds = []
    for r in range(args.rounds):
        first = [(7 * i + 13 * r) % 40000 + 100 for i in range(args.prompt_tokens)]
        answer = list(llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0].token_ids)
        turn = first + answer + [(11 * i + r) % 30000 + 200 for i in range(32)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": turn}], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    print(f"second turn s: {' '.join(f'{s:.2f}' for s in seconds)}; median {statistics.median(seconds):.2f}")


if __name__ == "__main__":
    main()
