"""Reasoning models' thinking split from the answer (``--reasoning-parser``): the think-tag rules
on whole texts and on streams cut anywhere, then a server whose answers are made to think (a
grammar writes the tags: the tiny random model has no thinking of its own), through both the
OpenAI chat API (``reasoning_content`` and ``reasoning``, whole and streamed, a tool call after
the thinking, the thinking sent back in a second turn) and Anthropic's (``thinking`` blocks)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS, reasoning_parser
from tests.helpers.server import MODEL_NAME, RemoteServer

CASES = [
    # (text, qwen3 (reasoning, content), deepseek_r1 (reasoning, content))
    ("<think>plan it</think>\n\nThe answer.", ("plan it", "The answer."), ("plan it", "The answer.")),
    ("plan it</think>The answer.", (None, "plan it</think>The answer."), ("plan it", "The answer.")),
    ("Just an answer.", (None, "Just an answer."), ("Just an answer.", "")),
    ("\n<think>cut off before the end", ("cut off before the end", ""), ("cut off before the end", "")),
    ("<think></think>Empty thinking.", ("", "Empty thinking."), ("", "Empty thinking.")),
    ("<thi", (None, "<thi"), ("<thi", "")),
    ("<think>a </thin b</think>c", ("a </thin b", "c"), ("a </thin b", "c")),
]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text,qwen3,deepseek_r1", CASES)
def test_whole_and_streamed_answers_split_alike(name: str, text: str, qwen3: tuple, deepseek_r1: tuple) -> None:
    parser = reasoning_parser(name)
    want = qwen3 if name == "qwen3" else deepseek_r1
    split = parser.split(text)
    assert (split.reasoning, split.content) == want
    for cut in range(1, 4):  # pieces of 1, 2 and 3 characters
        stream = parser.streamer()
        pieces = [stream.feed(text[i : i + cut], final=False) for i in range(0, len(text), cut)]
        pieces.append(stream.feed("", final=True))
        reasoning, content = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        assert (reasoning if stream.thought else None, content) == want, cut


def test_an_unknown_parser_is_refused_by_name() -> None:
    assert reasoning_parser(None) is None and set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "openai_gptoss"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        reasoning_parser("o1")


# ---- through the server ---------------------------------------------------------------------

# The tiny model thinks only when a grammar makes it: the thinking, then the answer (a grammar
# over the thinking too: --structured-outputs-config enable_in_reasoning).
THINKING = r"<think>[a-z]{3,8}( [a-z]{3,8}){0,3}</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\."
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinker(tiny_llama_path: str) -> Iterator[RemoteServer]:
    args = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", "64", "--max-model-len", "256",
            "--reasoning-parser", "qwen3", "--structured-outputs-config", '{"enable_in_reasoning": true}']  # fmt: skip
    with RemoteServer(tiny_llama_path, args) as remote:
        yield remote


def forced(pattern: str = THINKING) -> dict:
    return {"structured_outputs": {"regex": pattern}, "temperature": 0}


@pytest.mark.slow
def test_chat_answers_carry_their_thinking_apart(thinker: RemoteServer) -> None:
    with thinker.client() as client:
        whole = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=48, extra_body=forced())
        message = whole.choices[0].message.model_dump()
        assert message["reasoning_content"] == message["reasoning"] and message["reasoning"]
        assert message["content"][0].isupper() and "<think>" not in message["content"]
        stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=48, stream=True,
                                                extra_body=forced())  # fmt: skip
        reasoning, content = "", ""
        for chunk in stream:
            delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
        assert (reasoning, content) == (message["reasoning"], message["content"])
        hidden = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=48,
                                                extra_body={**forced(), "include_reasoning": False})  # fmt: skip
        assert hidden.choices[0].message.model_dump().get("reasoning") is None
        # The thinking goes back with the assistant's turn (a template may render it or not).
        history = [*ASK, {"role": "assistant", "content": message["content"], "reasoning_content": message["reasoning"]},
                   {"role": "user", "content": "And at sunset?"}]  # fmt: skip
        assert client.chat.completions.create(model=MODEL_NAME, messages=history, max_tokens=4).choices


@pytest.mark.slow
def test_a_tool_call_after_the_thinking(thinker: RemoteServer) -> None:
    """Calls are parsed from the content only: the thinking may mention a call's format freely."""
    call = r'<tool_call>\n\{"name": "get_time", "arguments": \{\}\}\n</tool_call>'
    pattern = r"<think>I need <tool_call> now</think>\n\n" + call
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    with thinker.client() as client:
        message = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=64, tools=tools,
                                                 extra_body=forced(pattern)).choices[0]  # fmt: skip
        assert message.finish_reason == "tool_calls" and message.message.tool_calls[0].function.name == "get_time"
        assert message.message.model_dump()["reasoning"] == "I need <tool_call> now"
        stream = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=64, tools=tools,
                                                stream=True, extra_body=forced(pattern))  # fmt: skip
        names = [c.function.name for chunk in stream if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        assert "get_time" in names
    with thinker.anthropic_client() as claude:  # whole and streamed alike: the call from after the thinking
        anthropic_tools = [{"name": "get_time", "input_schema": {"type": "object"}}]
        whole = claude.messages.create(model=MODEL_NAME, max_tokens=64, messages=ASK, tools=anthropic_tools,
                                       extra_body=forced(pattern))  # fmt: skip
        assert [b.type for b in whole.content] == ["thinking", "tool_use"] and whole.stop_reason == "tool_use"
        assert whole.content[0].thinking == "I need <tool_call> now"
        with claude.messages.stream(model=MODEL_NAME, max_tokens=64, messages=ASK, tools=anthropic_tools,
                                    extra_body=forced(pattern)) as stream:  # fmt: skip
            streamed = stream.get_final_message()
        assert [b.type for b in streamed.content] == ["thinking", "tool_use"]


@pytest.mark.slow
def test_responses_open_with_a_reasoning_item(thinker: RemoteServer) -> None:
    with thinker.client() as client:
        response = client.responses.create(model=MODEL_NAME, input="Why is the sky blue?", max_output_tokens=48,
                                           extra_body=forced())  # fmt: skip
        assert [item.type for item in response.output] == ["reasoning", "message"]
        thinking = response.output[0].content[0].text
        assert thinking and "<think>" not in response.output_text
        events = list(client.responses.create(model=MODEL_NAME, input="Why is the sky blue?", max_output_tokens=48,
                                              extra_body=forced(), stream=True))  # fmt: skip
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == thinking and events[-1].response.output_text == response.output_text
        # Continued: the reasoning goes back as the turn's reasoning_content.
        after = client.responses.create(model=MODEL_NAME, input="And at sunset?", previous_response_id=response.id,
                                        max_output_tokens=4)  # fmt: skip
        assert after.output


@pytest.mark.slow
def test_anthropic_answers_open_with_a_thinking_block(thinker: RemoteServer) -> None:
    with thinker.anthropic_client() as claude:
        message = claude.messages.create(model=MODEL_NAME, max_tokens=48, messages=ASK,
                                         thinking={"type": "enabled", "budget_tokens": 1024},
                                         extra_body=forced())  # fmt: skip
        assert [b.type for b in message.content] == ["thinking", "text"]
        thinking, text = message.content[0].thinking, message.content[1].text
        with claude.messages.stream(model=MODEL_NAME, max_tokens=48, messages=ASK, extra_body=forced(),
                                    thinking={"type": "enabled", "budget_tokens": 1024}) as stream:  # fmt: skip
            deltas = {e.delta.type for e in stream if e.type == "content_block_delta"}
            final = stream.get_final_message()
        assert {"thinking_delta", "text_delta"} <= deltas
        assert (final.content[0].thinking, final.content[1].text) == (thinking, text)
        # The thinking block goes back with the turn, as Anthropic's clients send it.
        history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                   {"role": "user", "content": "And at sunset?"}]  # fmt: skip
        assert claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=history).content is not None
    assert json.dumps(message.model_dump())  # the SDK's own model of the answer
