"""gpt-oss's harmony answers split into thinking, content and tool calls (``openai_gptoss``):
whole and streamed cut anywhere, then through the server (a grammar writes the markers: the tiny
random model has no harmony of its own)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pagellm.entrypoints.openai.reasoning import reasoning_parser
from pagellm.entrypoints.openai.tool_calls.parsers import HermesToolParser
from tests.helpers.server import MODEL_NAME, RemoteServer

PARSER = reasoning_parser("openai_gptoss")
THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
CASES = [
    (THINK + FINAL, "The user wants the weather.", "It is sunny."),
    ("<|channel|>final<|message|>Hello <there> <| x", None, "Hello <there> <| x"),  # cut off, a stray "<|"
    (THINK + "<|start|>assistant<|channel|>final<|message|>cut", "The user wants the weather.", "cut"),
    ("<|channel|>analysis<|message|>still thinking", "still thinking", ""),
    ('{"city": "Paris"}', None, '{"city": "Paris"}'),  # a constraint forced the answer: no channels
    ("<tool_call>\n{}\n</tool_call>", None, "<tool_call>\n{}\n</tool_call>"),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_whole_and_streamed_alike(text: str, reasoning: str | None, content: str) -> None:
    split = PARSER.split(text)
    assert (split.reasoning, split.content) == (reasoning, content)
    for cut in range(1, len(text)):
        stream = PARSER.streamer()
        parts = [stream.feed(text[:cut], final=False), stream.feed(text[cut:], final=True)]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == ((reasoning or ""), content), cut


def test_a_call_becomes_the_tool_parser_block() -> None:
    split = PARSER.split(THINK + CALL)
    assert split.reasoning == "The user wants the weather."
    calls = HermesToolParser().extract(split.content).calls
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    recipient_first = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
    assert [c.name for c in HermesToolParser().extract(PARSER.split(recipient_first).content).calls] == ["get_time"]
    assert PARSER.keeps_special_tokens and PARSER.constraint_thinking is None


# ---- through the server ---------------------------------------------------------------------

# The markers are text here (the default tokenizer has no harmony tokens); the parser reads text.
FORCED = (r"<\|channel\|>analysis<\|message\|>[a-z]{3,8}( [a-z]{3,8}){0,2}<\|end\|>"
          r"<\|start\|>assistant<\|channel\|>final<\|message\|>[A-Z][a-z]{2,8}\.")  # fmt: skip


@pytest.fixture(scope="module")
def gptoss_server(tiny_llama_path: str) -> Iterator[RemoteServer]:
    args = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", "64", "--max-model-len", "256",
            "--reasoning-parser", "openai_gptoss"]  # fmt: skip
    with RemoteServer(tiny_llama_path, args) as remote:
        yield remote


@pytest.mark.slow
def test_chat_and_responses_split_the_channels(gptoss_server: RemoteServer) -> None:
    body = {"structured_outputs": {"regex": FORCED}, "temperature": 0}
    ask = [{"role": "user", "content": "Why?"}]
    with gptoss_server.client() as client:
        message = client.chat.completions.create(model=MODEL_NAME, messages=ask, max_tokens=60, extra_body=body)
        answer = message.choices[0].message.model_dump()
        assert answer["reasoning"] and "<|" not in answer["reasoning"] and answer["content"][0].isupper()
        assert "<|" not in answer["content"] and answer["content"].endswith(".")
        response = client.responses.create(model=MODEL_NAME, input="Why?", max_output_tokens=60, extra_body=body)
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output_text == answer["content"]
        # A JSON schema constrains the whole answer (no channels then): it is the content.
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
        constrained = client.chat.completions.create(model=MODEL_NAME, messages=ask, max_tokens=30, temperature=0,
                                                     response_format={"type": "json_schema", "json_schema": {
                                                         "name": "a", "schema": schema}})  # fmt: skip
        assert isinstance(json.loads(constrained.choices[0].message.content)["a"], int)


def test_harmony_needs_the_hermes_tool_parser() -> None:
    from pagellm.entrypoints.openai.api_server import ServerSettings

    with pytest.raises(ValueError, match="use --tool-call-parser hermes"):
        ServerSettings(served_model_names=["m"], reasoning_parser="openai_gptoss", tool_call_parser="llama3_json")
