"""Micro-benchmark: the grammar engine of structured outputs, llguidance (pagellm's) against
outlines-core (the alternative measured; optional, ``pip install outlines-core``), on the default
model's 49,152-token vocabulary, plus the cost of applying the masks to a batch of logits.

For each engine: time to prepare the vocabulary, time to compile each schema (cold, in a fresh
process state: the first compile of that schema), and time per token to compute the allowed-token
mask while walking a valid document for the schema. Then pagellm's ``apply_token_bitmask`` on
[rows, 49,152] logits, its C++ kernel and its torch reference. Prints a table and, with ``--output-json``, writes the figures.

    python benchmarks/structured_micro.py [--rows 1,16,64] [--output-json structured.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagellm import kernels  # noqa: E402
from pagellm.model.default_model import default_model_path  # noqa: E402
from pagellm.model.tokenizer import load_tokenizer  # noqa: E402
from pagellm.sample.grammar_mask import apply_token_bitmask  # noqa: E402
from pagellm.structured_output.grammar import grammar_source, llguidance_tokenizer, parser_limits  # noqa: E402
from pagellm.structured_outputs_params import StructuredOutputsParams  # noqa: E402

VOCAB = 49152
# name -> (schema, a valid document written as the constraint writes it)
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
        {"name": "Ada Lovelace", "age": 36, "ok": True},
    ),
    "nested": (
        {"type": "object", "properties": {
            "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                                      "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                     "required": ["id", "email"]},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
            "score": {"anyOf": [{"type": "number"}, {"type": "null"}]}},
         "required": ["user", "tags", "score"]},
        {"user": {"id": 12345, "email": "ada@example.com"}, "tags": ["red", "blue", "green"], "score": 0.75},
    ),
}  # fmt: skip


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _document_ids(tokenizer: Any, document: Any) -> list[int]:
    text = json.dumps(document, separators=(", ", ": "))
    return tokenizer.encode(text, add_special_tokens=False)


def bench_llguidance(tokenizer: Any) -> dict[str, Any]:
    from llguidance import LLMatcher
    from llguidance.torch import fill_next_token_bitmask

    lt, vocab_s = _timed(lambda: llguidance_tokenizer(tokenizer, VOCAB, tokenizer.eos_token_id))
    result: dict[str, Any] = {"engine": "llguidance", "vocab_s": vocab_s, "cases": {}}
    bitmask = torch.empty(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for name, (schema, document) in CASES.items():
        source = grammar_source(StructuredOutputsParams(json=schema))
        matcher, compile_s = _timed(lambda: LLMatcher(lt, source, limits=parser_limits()))
        ids = _document_ids(tokenizer, document)
        mask_s = 0.0
        for token in ids:
            _, dt = _timed(lambda: fill_next_token_bitmask(matcher, bitmask, 0))
            mask_s += dt
            assert matcher.consume_token(token), matcher.get_error()
        result["cases"][name] = {"compile_ms": compile_s * 1e3, "mask_us_per_token": mask_s / len(ids) * 1e6,
                                 "tokens": len(ids)}  # fmt: skip
    return result


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _outlines_vocabulary(tokenizer: Any) -> Any:
    """outlines-core's vocabulary: each token's bytes (byte-level BPE undone), EOS apart."""
    from outlines_core import Vocabulary

    byte_of = _byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= VOCAB:
            continue
        vocab.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
    return Vocabulary(tokenizer.eos_token_id, vocab)


def bench_outlines(tokenizer: Any) -> dict[str, Any] | None:
    try:
        from outlines_core import Guide, Index
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    vocabulary, vocab_s = _timed(lambda: _outlines_vocabulary(tokenizer))
    result: dict[str, Any] = {"engine": "outlines-core", "vocab_s": vocab_s, "cases": {}}
    bitmask = torch.empty((VOCAB + 31) // 32, dtype=torch.int32)
    for name, (schema, document) in CASES.items():
        regex = build_regex_from_schema(json.dumps(schema), r"[ ]?")
        index, compile_s = _timed(lambda: Index(regex, vocabulary))
        guide = Guide(index)
        ids = _document_ids(tokenizer, document)
        mask_s = 0.0
        for token in ids:
            _, dt = _timed(lambda: guide.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4))
            mask_s += dt
            guide.advance(token)
        result["cases"][name] = {"compile_ms": compile_s * 1e3, "mask_us_per_token": mask_s / len(ids) * 1e6,
                                 "tokens": len(ids)}  # fmt: skip
    return result


def bench_apply(rows: list[int], reps: int = 20) -> dict[str, dict[str, float]]:
    """ms to mask [r, 49152] float32 logits: the C++ kernel (what the engine runs on CPU) and the
    torch reference, for each row count."""
    lib = kernels.default()
    out: dict[str, dict[str, float]] = {}
    for name, library in (("kernel", lib), ("torch", None)):
        if name == "kernel" and lib is None:
            continue
        out[name] = {}
        for r in rows:
            logits = torch.randn(r, VOCAB)
            bitmask = torch.randint(-(2**31), 2**31 - 1, (r, (VOCAB + 31) // 32), dtype=torch.int32)
            index: list[int | None] = list(range(r))
            apply_token_bitmask(logits, bitmask, index, library)
            start = time.perf_counter()
            for _ in range(reps):
                apply_token_bitmask(logits, bitmask, index, library)
            out[name][str(r)] = (time.perf_counter() - start) / reps * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(default_model_path())
    engines = [r for r in (bench_llguidance(tokenizer), bench_outlines(tokenizer)) if r is not None]
    print(f"{'engine':14} {'vocab s':>8} " + " ".join(f"{n + ' compile ms':>20} {n + ' mask us/tok':>20}" for n in CASES))
    for r in engines:
        cells = " ".join(f"{c['compile_ms']:>20.1f} {c['mask_us_per_token']:>20.1f}" for c in r["cases"].values())
        print(f"{r['engine']:14} {r['vocab_s']:>8.2f} {cells}")
    apply = bench_apply([int(x) for x in args.rows.split(",")])
    for name, times in apply.items():
        print(f"apply_token_bitmask ({name}) ms on [rows, 49152]: " + ", ".join(f"{k} rows {v:.2f}" for k, v in times.items()))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"engines": engines, "apply_ms": apply}, indent=2))


if __name__ == "__main__":
    main()
