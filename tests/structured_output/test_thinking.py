"""Constraints after a reasoning model's thinking (``StructuredOutputsParams.thinking``): the
grammar lets the thinking run free to its ``</think>``, then holds the answer to the constraint;
the chat endpoints set it from ``--reasoning-parser``; the engine samples under it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from llguidance import LLMatcher

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.engine.input_processor import InputProcessor
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.reasoning import reasoning_parser
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.structured_outputs import enable_in_reasoning
from pagellm.structured_output.grammar import grammar_source, llguidance_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CONSTRAINTS = [dict(json=SCHEMA), dict(regex="[a-z]{3}"), dict(choice=["Yes", "No"]),
               dict(grammar='start: "n" NUM\nNUM: /[0-9]/'), dict(grammar='root ::= "n" [0-9]')]  # fmt: skip
# One answer each constraint takes, and one it refuses.
ANSWERS = {"json": ('{"a": 2}', '{"b": 2}'), "regex": ("abc", "ab1"), "choice": ("Yes", "Maybe"),
           "grammar": ("n7", "m7")}  # fmt: skip


def _accepts(matcher: LLMatcher, tokenizer, text: str) -> str:
    """"complete", "prefix" (every token taken, more to come) or "refused"."""
    copy = matcher.deep_copy()
    if not all(copy.consume_token(t) for t in tokenizer(text, add_special_tokens=False).input_ids):
        return "refused"
    return "complete" if copy.is_stopped() else "prefix"


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: next(iter(c)))
def test_the_answer_is_constrained_after_the_thinking(default_tokenizer, constraint: dict) -> None:
    tokens = llguidance_tokenizer(default_tokenizer, len(default_tokenizer), default_tokenizer.eos_token_id)
    good, bad = ANSWERS[next(iter(constraint))]
    optional = LLMatcher(tokens, grammar_source(StructuredOutputsParams(**constraint, thinking="optional")), log_level=0)
    opened = LLMatcher(tokens, grammar_source(StructuredOutputsParams(**constraint, thinking="open")), log_level=0)
    assert not optional.is_error() and not opened.is_error()
    thought = "<think>It could be {\"b\": 1}, or Maybe.</think>"
    for text, expected in [(good, "complete"), (bad, "refused"), (f"{thought}\n\n{good}", "complete"),
                           (f"{thought}{good}", "complete"), (f"{thought}\n\n{bad}", "refused"),
                           ("<think>still thinking", "prefix"), (f" {thought}{good}", "refused")]:  # fmt: skip
        assert _accepts(optional, default_tokenizer, text) == expected, text
    for text, expected in [(f"Plan: {bad}.</think>\n\n{good}", "complete"), (f"{thought}\n{good}", "complete"),
                           (f"Plan.</think>\n\n{bad}", "refused"), (good, "prefix")]:  # fmt: skip
        assert _accepts(opened, default_tokenizer, text) == expected, text  # (an unclosed answer is thinking)


def test_thinking_is_validated_and_keyed() -> None:
    with pytest.raises(ValueError, match="thinking must be one of optional, open"):
        StructuredOutputsParams(regex="a", thinking="closed")
    assert StructuredOutputsParams(regex="a").cache_key() != StructuredOutputsParams(regex="a", thinking="open").cache_key()


def _chat(default_tokenizer, parser: str | None, in_reasoning: bool = False) -> OpenAIServingChat:
    processor = InputProcessor(default_tokenizer, len(default_tokenizer), 512)
    engine = SimpleNamespace(input_processor=processor, tokenizer=default_tokenizer, max_model_len=512)
    return OpenAIServingChat(engine, ["m"], reasoning_parser=reasoning_parser(parser),  # type: ignore[arg-type]
                             constrain_thinking=in_reasoning)  # fmt: skip


@pytest.mark.parametrize(("parser", "in_reasoning", "thinking"),
                         [("qwen3", False, "optional"), ("deepseek_r1", False, "open"), ("qwen3", True, None),
                          (None, False, None)])  # fmt: skip
def test_chat_constraints_follow_the_reasoning_parser(default_tokenizer, parser, in_reasoning, thinking) -> None:
    chat = _chat(default_tokenizer, parser, in_reasoning)
    ask = [{"role": "user", "content": "hi"}]
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                 {"structured_outputs": {"choice": ["Yes", "No"]}},
                 {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"}):
        _, params, _ = chat.prepare(ChatCompletionRequest(messages=ask, **body))
        assert params.structured_outputs is not None and params.structured_outputs.thinking == thinking
    _, free, _ = chat.prepare(ChatCompletionRequest(messages=ask))
    assert free.structured_outputs is None


def test_the_structured_outputs_config_flag() -> None:
    assert enable_in_reasoning(None) is False and enable_in_reasoning('{"enable_in_reasoning": true}') is True
    for bad, words in [("[]", "JSON object"), ('{"backend": "xgrammar"}', "not supported"),
                       ('{"enable_in_reasoning": 1}', "true or false"), ("{", "not valid JSON")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            enable_in_reasoning(bad)


def test_the_engine_samples_under_the_thinking_grammar(tiny_llama_path: str) -> None:
    """Sampled freely, every finished answer is a thinking block (or none) and then a choice."""
    llm = LLM(tiny_llama_path, num_kv_blocks=128)
    constraint = StructuredOutputsParams(choice=["Yes", "No"], thinking="optional")
    params = [SamplingParams(temperature=1.5, seed=seed, max_tokens=40, structured_outputs=constraint)
              for seed in range(12)]  # fmt: skip
    outputs = [o.outputs[0] for o in llm.generate(["Is the sky blue?"] * len(params), params, use_tqdm=False)]
    finished = [o.text for o in outputs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outputs]
    for text in finished:
        assert re.fullmatch(r"(<think>.*?</think>\n*)?(Yes|No)", text, re.DOTALL), text
    for output in outputs:  # cut off: a prefix of the language (here: inside the thinking)
        assert output.text.startswith(("<", "Y", "N")), output.text
