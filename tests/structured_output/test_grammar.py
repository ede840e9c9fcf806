"""Structured outputs below the engine: the request's constraint, its grammar, the compiler
off the caller's thread, and the packed mask applied to logits."""

from __future__ import annotations

import threading

import pytest
import torch

from pagellm import SamplingParams, StructuredOutputsParams, kernels
from pagellm.sample.grammar_mask import apply_token_bitmask, unpack_bitmask
from pagellm.structured_output.grammar import GrammarCompiler, check_grammar, llguidance_tokenizer, plain_error


def test_exactly_one_kind_of_constraint() -> None:
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one of .*got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=["a", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


def test_one_compile_key_per_constraint() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}})
    reordered = StructuredOutputsParams(json={"properties": {"x": {"type": "integer"}}, "type": "object"})
    assert a.cache_key() == reordered.cache_key()  # keys sorted: the same schema, one compile
    assert a.cache_key() != StructuredOutputsParams(json={"type": "object"}).cache_key()
    assert a.cache_key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).cache_key()
    assert a.cache_key() != StructuredOutputsParams(regex="x").cache_key()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="a(b"), "unclosed group"),
        (StructuredOutputsParams(json={"type": "objectx"}), "objectx"),
        (StructuredOutputsParams(grammar="start: item+\nitem: UNDEFINED_RULE"), "UNDEFINED_RULE"),
        (StructuredOutputsParams(json={"type": "string", "pattern": "[z-a]"}), "regex"),
    ],
)
def test_a_constraint_that_does_not_compile_is_named(params: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{params.kind}") as info:
        check_grammar(params)
    assert message.lower() in str(info.value).lower()


def test_good_constraints_compile() -> None:
    for params in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": [1, 2]}}}),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(choice=['say "hi"', "no"]),
        StructuredOutputsParams(grammar='start: "yes" | "no"'),
        StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF, as llama.cpp writes it
        StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
    ):
        check_grammar(params)


def test_the_compiler_works_off_the_callers_thread(default_tokenizer) -> None:
    """The first compile prepares the vocabulary on the compile thread: submit never waits."""
    release = threading.Event()

    def make_tokenizer():
        release.wait()
        return llguidance_tokenizer(default_tokenizer, len(default_tokenizer), default_tokenizer.eos_token_id)

    compiler = GrammarCompiler(make_tokenizer)
    try:
        params = StructuredOutputsParams(choice=["yes", "no"])
        future = compiler.submit(params)
        assert not future.done()
        release.set()
        matcher = future.result(timeout=60)
        again = compiler.submit(params)  # cached: done at once, a fresh copy
        assert again.done() and again.result() is not matcher
        yes = default_tokenizer.encode("yes", add_special_tokens=False)
        assert matcher.consume_tokens(yes) and matcher.is_accepting()
        assert not again.result().is_accepting()  # the copy did not move with the first
        bad = compiler.submit(StructuredOutputsParams(regex="a(b"))
        with pytest.raises(ValueError, match="structured_outputs.regex does not compile"):
            bad.result(timeout=60)
    finally:
        compiler.shutdown()


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
    expected = logits.clone()
    for i, r in enumerate(rows):
        if r is None:
            continue
        for t in range(logits.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[r, word]) >> (t % 32)) & 1
            if not allowed:
                expected[i, t] = float("-inf")
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_forbids_exactly_the_cleared_bits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int32)
    bitmask[1] = -1  # all allowed
    logits = torch.randn(4, vocab, generator=g).to(dtype)
    rows: list[int | None] = [2, None, 0, 1]
    expected = _reference_mask(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert unpack_bitmask(bitmask[1:2], vocab).all()


def test_tokens_beyond_the_mask_are_forbidden() -> None:
    logits = torch.zeros(1, 70)
    apply_token_bitmask(logits, torch.full((1, 1), -1, dtype=torch.int32), [0])  # covers tokens 0..31
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()
    with pytest.raises(ValueError, match="2 row entries for 1 logits rows"):
        apply_token_bitmask(logits, torch.zeros((1, 3), dtype=torch.int32), [0, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 31, 100, 49152 + 64])
def test_the_kernel_mask_equals_the_torch_one(dtype: torch.dtype, vocab: int) -> None:
    lib = kernels.default()
    if lib is None:
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(vocab)
    words = min(-(-vocab // 32), 1536)  # the widest case masks fewer tokens than the logits hold
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int32)
    bitmask[0, : words // 2] = -1
    bitmask[2] = 0
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    rows: list[int | None] = [1, None, 0, 2, 1]
    expected = logits.clone()
    apply_token_bitmask(expected, bitmask, rows)  # torch reference
    apply_token_bitmask(logits, bitmask, rows, lib)
    assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="point past the bitmask"):
        lib.apply_token_bitmask_(logits, bitmask, torch.tensor([0, 1, 2, 3, -1]))


def test_a_deep_rule_chain_is_checked_on_a_deep_stack() -> None:
    """3,000 chained Lark rules overflowed an 8 MiB thread stack inside llguidance (a crash of the
    whole process); on the checker's deep stack they compile."""
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3000)) + '\nr3000: "b"'
    check_grammar(StructuredOutputsParams(grammar=chain))
    schema = {"$ref": "#/$defs/d0", "$defs": {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(2500)}}
    schema["$defs"]["d2500"] = {"type": "string"}
    check_grammar(StructuredOutputsParams(json=schema))


def test_a_constraint_over_the_size_limit_is_refused_before_compiling() -> None:
    from pagellm.engine.input_processor import InputProcessor
    from pagellm.config import LimitsConfig

    class Vocab:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    processor = InputProcessor(Vocab(), 10, 64, LimitsConfig(max_grammar_chars=100))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"choice is 2\d\d characters long.*max_grammar_chars"):
        processor.check_params(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["abcd"] * 50)))
    processor.check_params(SamplingParams(structured_outputs=StructuredOutputsParams(choice=["abcd"] * 10)))


def test_json_text_in_a_constraint_is_bounded() -> None:
    with pytest.raises(ValueError, match="structured_outputs.json is nested deeper than 128 levels"):
        StructuredOutputsParams(json="[" * 10_000 + "]" * 10_000)
    with pytest.raises(ValueError, match="structured_outputs.json is nested deeper than 128 levels"):
        StructuredOutputsParams(json="[" * 200 + "]" * 200)
    deep: dict = {}
    for _ in range(200):
        deep = {"a": deep}
    with pytest.raises(ValueError, match="structured_outputs.json is nested deeper"):
        StructuredOutputsParams(json=deep)
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json='{"a": ' + "1" * 5000 + "}")  # past Python's integer digit limit


@pytest.mark.parametrize(("raw", "reason"), [
    ("panic: too many symbols: 70000 > 65535\nstack backtrace:\n   0: llguidance::x\n   at src/x.rs:1:2",
     "(too many symbols: 70000 > 65535)"),
    ("thread '<unnamed>' panicked at parser/src/earley/grammar.rs:120:9:\nsymbol limit\nnote: run with RUST_BACKTRACE",
     "symbol limit"),
])
def test_a_caught_panic_is_reported_in_plain_words(raw: str, reason: str) -> None:
    message = plain_error(raw)
    assert message.startswith("the grammar engine cannot handle this constraint") and reason in message
    assert "backtrace" not in message.lower() and ".rs" not in message and "panic" not in message


def test_other_errors_are_kept() -> None:
    assert plain_error("1(3): unknown rule foo\n") == "1(3): unknown rule foo"


def test_a_stack_that_cannot_be_mapped_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a strict overcommit policy the deep stack may not map: grammars are still checked."""
    from pagellm.structured_output import grammar

    monkeypatch.setattr(grammar, "GRAMMAR_STACK_BYTES", 1 << 45)  # 32 TiB: never mapped
    pool = grammar.deep_stack_executor("pagellm-test")
    try:
        assert pool.submit(lambda: threading.current_thread().name).result().startswith("pagellm-test")
    finally:
        pool.shutdown()
