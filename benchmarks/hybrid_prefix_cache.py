"""Time to first token of a long prompt on a hybrid model, the first time and again from the
prefix cache: LFM2 (short convolutions: a state kept at every block) or, with ``--model``, any
model, such as Qwen3.5 or Granite-4.0-H (scan layers: states kept at sparse points,
docs/engine.md). Issue 37's target: the repeat >= 5x faster.

    python benchmarks/hybrid_prefix_cache.py [--prompt-tokens 2048] [--repeats 3] [--hidden 512]
        [--layers 8] [--model PATH] [--second repeat|shared|turn] [--suffix-tokens 64]
        [--answer-tokens 64] [--num-threads N] [--output-json FILE]

Without ``--model`` it writes a random-weight LFM2 of the given width (layers alternate two
convolutions and one attention layer, as LFM2's). Per round, a fresh prompt of ``--prompt-tokens``
random ids is answered, and a second request is timed (around ``LLM.generate``, ``max_tokens=1``)
twice: first under a fresh ``cache_salt`` (no hit: every token computed), then from the cache.
The second (``--second``): ``repeat`` the same prompt; ``shared`` its first ``prompt-tokens -
suffix-tokens`` ids and ``--suffix-tokens`` new ones (a system prompt shared by different
questions; one more question comes before it, untimed: the first to share the prefix keeps the
state where it ends, the later ones resume there); ``turn`` the whole prompt, its answer
(``--answer-tokens``) and ``--suffix-tokens`` new ids (a conversation's next turn). Prints a table and the medians as JSON.
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
    parser.add_argument("--model", help="a model to serve instead of the random LFM2 (a folder or a GGUF file)")
    parser.add_argument("--second", choices=("repeat", "shared", "turn"), default="repeat")
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--answer-tokens", type=int, default=64, help="turn: the first answer's tokens")
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    context = 2 * args.prompt_tokens + args.suffix_tokens + args.answer_tokens + 64
    with tempfile.TemporaryDirectory() as folder:
        path = args.model or write_model(Path(folder), args.hidden, args.layers, context)
        llm = LLM(path, dtype="bfloat16", max_model_len=context, max_num_batched_tokens=512,
                  num_threads=args.num_threads)  # fmt: skip
        rows, cached = _rounds(llm, args)
    first = statistics.median(t[0] for t in rows)
    again = statistics.median(t[1] for t in rows)
    model = args.model or f"LFM2-shaped hybrid, hidden {args.hidden}, {args.layers} layers"
    print(f"{model}, prompt {args.prompt_tokens} tokens, second request: {args.second}")
    print(f"{'round':<8}{'uncached s':>11}{'cached s':>10}{'speedup':>10}{'cached':>8}")
    for i, ((a, b), hit) in enumerate(zip(rows, cached), 1):
        print(f"{i:<8}{a:>11.3f}{b:>10.3f}{a / b:>9.1f}x{hit:>8}")
    print(f"{'median':<8}{first:>11.3f}{again:>10.3f}{first / again:>9.1f}x")
    result = {"model": model, "prompt_tokens": args.prompt_tokens, "second": args.second,
              "suffix_tokens": args.suffix_tokens, "uncached_s": first, "cached_s": again, "speedup": first / again,
              "cached_tokens": cached}  # fmt: skip
    print(json.dumps(result))
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))


def _rounds(llm: LLM, args: argparse.Namespace) -> tuple[list[list[float]], list[int]]:
    """Each round's second request timed without the cache (a fresh ``cache_salt``: every token
    computed) and with it, and the prompt tokens it took from the cache."""
    generator = torch.Generator().manual_seed(0)
    rows, cached = [], []
    one = SamplingParams(max_tokens=1, temperature=0)
    for round_ in range(args.repeats + 1):  # (round 0 warms up)
        ids = torch.randint(100, 20000, (args.prompt_tokens,), generator=generator).tolist()
        suffix = torch.randint(100, 20000, (args.suffix_tokens,), generator=generator).tolist()
        answer = SamplingParams(max_tokens=args.answer_tokens if args.second == "turn" else 1, temperature=0,
                                ignore_eos=True)  # fmt: skip
        out = llm.generate([{"prompt_token_ids": ids}], answer, use_tqdm=False)  # (what the cache then holds)
        if args.second == "shared":  # a question before: it keeps the state where the shared prefix ends
            other = torch.randint(100, 20000, (args.suffix_tokens,), generator=generator).tolist()
            llm.generate([{"prompt_token_ids": ids[: len(ids) - len(other)] + other}], one, use_tqdm=False)
        second = {"repeat": ids, "shared": ids[: len(ids) - len(suffix)] + suffix,
                  "turn": ids + list(out[0].outputs[0].token_ids) + suffix}[args.second]  # fmt: skip
        times = []
        for salt in (f"uncached {round_}", None):
            prompt = {"prompt_token_ids": second} | ({"cache_salt": salt} if salt else {})
            start = time.perf_counter()
            out = llm.generate([prompt], one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        if round_:
            rows.append(times)
            cached.append(out[0].num_cached_tokens)
    return rows, cached


if __name__ == "__main__":
    main()
