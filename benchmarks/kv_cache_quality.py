"""What an fp8 KV cache costs in quality: teacher-forced perplexity, stored K/V in bf16 vs fp8.

    python benchmarks/kv_cache_quality.py [--model M] [--tokens 1000] [--output-json FILE]

Scores text chunks (by default this project's README and benchmarks/NOTES.md, ``--tokens``
tokens each) with ``prompt_logprobs``: every position's logits come from attention over the
cache as stored, so the fp8 rounding of K/V is what is measured. Prints the mean negative
log-likelihood and the perplexity per ``kv_cache_dtype`` and, per dtype, the largest change of
a token's log-probability against ``auto``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [ROOT / "README.md", ROOT / "benchmarks" / "NOTES.md"]


def chunks(tokenizer, tokens: int, per_file: int = 2) -> list[list[int]]:
    """``per_file`` chunks of ``tokens`` tokens from each text file."""
    out = []
    for path in TEXTS:
        ids = tokenizer(path.read_text(encoding="utf-8"))["input_ids"]
        out.extend(ids[i * tokens : (i + 1) * tokens] for i in range(per_file) if len(ids) >= (i + 1) * tokens)
    return out


def token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([e[ids[p]].logprob for p, e in enumerate(out[0].prompt_logprobs) if e is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    reference: list[torch.Tensor] = []
    for kv in ("auto", "fp8"):
        llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=kv, enable_prefix_caching=False)
        texts = chunks(llm.get_tokenizer(), args.tokens)
        lps = [token_logprobs(llm, ids) for ids in texts]
        if kv == "auto":
            reference = lps
        nll = -torch.cat(lps).mean().item()
        shift = max((a - b).abs().max().item() for a, b in zip(lps, reference))
        results[kv] = dict(tokens=sum(len(lp) for lp in lps), mean_nll=nll, perplexity=math.exp(nll), max_logprob_change=shift)
        del llm

    print(f"{'kv_cache_dtype':<15} {'tokens':>7} {'mean NLL':>9} {'perplexity':>11} {'max |dlogprob|':>15}")
    for kv, r in results.items():
        print(f"{kv:<15} {r['tokens']:>7} {r['mean_nll']:>9.4f} {r['perplexity']:>11.3f} {r['max_logprob_change']:>15.3f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
