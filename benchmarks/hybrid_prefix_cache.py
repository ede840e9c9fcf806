"""Time to first token of a repeated long prompt on a hybrid model (LFM2: short-convolution
layers beside attention), the first time and again from the prefix cache, where the cached
blocks' convolution states let the repeat skip its prompt (issue 37's target: >= 5x faster).

    python benchmarks/hybrid_prefix_cache.py [--prompt-tokens 2048] [--repeats 3] [--hidden 512]
                                             [--layers 8] [--output-json FILE]

Writes a random-weight LFM2 of the given width (layers alternate two convolutions and one
attention layer, as LFM2's), then per round: a fresh prompt of ``--prompt-tokens`` random ids
(first time: every token computed) and the same prompt again (its full blocks from the cache),
each ``max_tokens=1``, timed around ``LLM.generate``. Prints a table and the medians as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402


def write_model(folder: Path, hidden: int, layers: int, context: int) -> str:
    """A random LFM2 of this shape with the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    from pagellm.model.default_model import default_model_path
    from pagellm.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    types = ["full_attention" if i % 3 == 2 else "conv" for i in range(layers)]
    config = Lfm2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                        max_position_embeddings=context, vocab_size=len(tokenizer), layer_types=types,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = write_model(Path(folder), args.hidden, args.layers, 2 * args.prompt_tokens)
        llm = LLM(path, dtype="bfloat16", max_model_len=2 * args.prompt_tokens, max_num_batched_tokens=512)
        params = SamplingParams(max_tokens=1, temperature=0)
        generator = torch.Generator().manual_seed(0)
        rows = []
        for round_ in range(args.repeats + 1):  # (round 0 warms up)
            ids = torch.randint(100, 20000, (args.prompt_tokens,), generator=generator).tolist()
            times = []
            for _ in range(2):
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            if round_:
                rows.append(times)
    first = statistics.median(t[0] for t in rows)
    again = statistics.median(t[1] for t in rows)
    print(f"LFM2-shaped hybrid, hidden {args.hidden}, {args.layers} layers, prompt {args.prompt_tokens} tokens")
    print(f"{'round':<8}{'first s':>10}{'repeat s':>10}{'speedup':>10}")
    for i, (a, b) in enumerate(rows, 1):
        print(f"{i:<8}{a:>10.3f}{b:>10.3f}{a / b:>9.1f}x")
    print(f"{'median':<8}{first:>10.3f}{again:>10.3f}{first / again:>9.1f}x")
    result = {"prompt_tokens": args.prompt_tokens, "hidden": args.hidden, "layers": args.layers,
              "first_s": first, "repeat_s": again, "speedup": first / again}  # fmt: skip
    print(json.dumps(result))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
