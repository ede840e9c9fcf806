"""What each weight format, ISA path and KV-cache dtype costs in quality: teacher-forced
perplexity of a fixed text against the float32 model dequantized from the same weights.

    python benchmarks/kv_cache_quality.py [--model M] [--tokens 1000] [--chunks 4] [--output-json FILE]
                                          [--only LABEL ...]

Scores ``--chunks`` chunks of ``--tokens`` tokens of ``benchmarks/data/quality_text.md`` (a
frozen copy of this project's README and notes, so the figures stay comparable across
commits) with ``prompt_logprobs``: every position's logits come from the engine's own path (its
weights, its GEMM, attention over the cache as stored). Prints per configuration the tokens
scored, mean negative log-likelihood, perplexity, its change against the float32 dense
reference (first row), and the largest change of one token's log-probability.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import LLM, SamplingParams  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "quality_text.md"
# (label, LLM options): the reference first. Scoring a chunk is one 1000-row prefill: on an
# AMX machine quantized linears run such batches on their dense bf16 copy (KernelPlan
# quant_max_rows), so the integer GEMM's rows cap the plan below AMX (cpu_isa="avx512").
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("float32 dense (reference)", dict(dtype="float32", quantization="none")),
    ("bfloat16 dense", dict(dtype="bfloat16", quantization="none")),
    ("gguf, float32 act., integer GEMM", dict(dtype="float32", quantization="gguf")),
    ("gguf, bf16, integer GEMM", dict(dtype="bfloat16", quantization="gguf", cpu_isa="avx512")),
    ("gguf, bf16, integer GEMM, avx2", dict(dtype="bfloat16", quantization="gguf", cpu_isa="avx2")),
    ("gguf, bf16, AMX plan (default)", dict(dtype="bfloat16", quantization="gguf")),
    ("int8, bf16, integer GEMM", dict(dtype="bfloat16", quantization="int8", cpu_isa="avx512")),
    ("bfloat16 dense, fp8 KV cache", dict(dtype="bfloat16", quantization="none", kv_cache_dtype="fp8")),
    ("gguf, bf16, integer GEMM, fp8 KV",
     dict(dtype="bfloat16", quantization="gguf", cpu_isa="avx512", kv_cache_dtype="fp8")),
    ("bfloat16 dense, int8 KV cache", dict(dtype="bfloat16", quantization="none", kv_cache_dtype="int8")),
    ("gguf, bf16, integer GEMM, int8 KV",
     dict(dtype="bfloat16", quantization="gguf", cpu_isa="avx512", kv_cache_dtype="int8")),
]


def chunks(tokenizer: Any, tokens: int, count: int) -> list[list[int]]:
    """``count`` consecutive chunks of ``tokens`` tokens of the frozen text."""
    ids = tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count) if len(ids) >= (i + 1) * tokens]


def token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Each position's log-probability of the text's next token (the first has none)."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([e[ids[p]].logprob for p, e in enumerate(out[0].prompt_logprobs) if e is not None])


def score(model: str | None, options: dict[str, Any], tokens: int, count: int) -> tuple[list[torch.Tensor], str]:
    """The per-token log-probabilities of every chunk under one configuration, and its plan."""
    llm = LLM(model, enable_prefix_caching=False, **options)
    texts = chunks(llm.get_tokenizer(), tokens, count)
    info = llm.llm_engine.kernel_plan_info
    plan = " ".join(f"{k}={v.replace(' ', ',')}" for k, v in info.items() if k != "device")
    return [token_logprobs(llm, ids) for ids in texts], plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--only", nargs="*", default=None, help="labels to run besides the reference")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    results: dict[str, dict[str, Any]] = {}
    reference: list[torch.Tensor] = []
    for label, options in CONFIGS:
        if reference and args.only is not None and label not in args.only:
            continue
        lps, plan = score(args.model, options, args.tokens, args.chunks)
        reference = reference or lps
        nll = -torch.cat(lps).mean().item()
        ref_nll = -torch.cat(reference).mean().item()
        shift = max((a - b).abs().max().item() for a, b in zip(lps, reference))
        results[label] = dict(
            options=options, kernel_plan=plan, tokens=sum(len(lp) for lp in lps), mean_nll=nll,
            perplexity=math.exp(nll), perplexity_change_pct=(math.exp(nll - ref_nll) - 1) * 100,
            max_logprob_change=shift,
        )

    header = f"{'configuration':<38} {'tokens':>7} {'mean NLL':>9} {'perplexity':>11} {'vs fp32':>8} {'max |dlogprob|':>15}"
    print(header)
    for label, r in results.items():
        print(f"{label:<38} {r['tokens']:>7} {r['mean_nll']:>9.4f} {r['perplexity']:>11.3f} "
              f"{r['perplexity_change_pct']:>+7.2f}% {r['max_logprob_change']:>15.3f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
