"""A JSON-constrained request's decode with a draft model against the same engine without
speculation (docs/speculative-decoding.md, structured outputs).

    python benchmarks/constrained_drafts.py [--model F] [--max-tokens 160] [--rounds 3]

The model (default: the default GGUF) is served dequantized (``quantization="none"``); the
speculating engine drafts with the model's own blocks on the integer GEMM (``"quantization":
"gguf"``, 4 drafts a step, adaptive as by default). One request at a time, greedy, constrained
to a JSON schema of an array of objects; the two engines alternate round by round. Prints each
round's decode rate (generated tokens over seconds), the medians and the drafts' acceptance.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagellm import LLM, SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

SCHEMA = {
    "type": "array", "minItems": 8, "maxItems": 8,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 12}},
              "required": ["name", "age", "city"], "additionalProperties": False},
}  # fmt: skip
PROMPT = "List eight people as JSON objects with a name, an age and a city:\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    common = dict(quantization="none", num_threads=args.num_threads, kv_cache_memory="1GiB", enable_prefix_caching=False)
    engines = {
        "plain": LLM(args.model, **common),
        "draft": LLM(args.model, **common, speculative_config={"method": "draft_model", "quantization": "gguf",
                                                               "num_speculative_tokens": 4}),
    }  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    texts = {}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
            rates[name].append(len(out.token_ids) / (time.perf_counter() - start))
            texts[name] = out.text
    stats = engines["draft"].llm_engine.scheduler.speculator.stats
    for name, values in rates.items():
        print(f"{name:5s} tok/s {' '.join(f'{v:.1f}' for v in values)}; median {statistics.median(values):.1f}")
    print(f"ratio draft / plain: {statistics.median(rates['draft']) / statistics.median(rates['plain']):.2f}; "
          f"acceptance {stats.acceptance_rate:.2f}, {stats.mean_accepted_length:.2f} tokens a verifying step; "
          f"same text: {texts['plain'] == texts['draft']}")


if __name__ == "__main__":
    main()
