"""Function calling: the call formats (whole and streamed), the grammar that forces a valid
call, the prompt for templates without tools, and /v1/chat/completions with tools (tiny random
model: only the grammar makes its calls valid)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from llguidance import LLMatcher

from pagellm.entrypoints.openai.tool_calls.parsers import HermesToolParser, Llama3JsonToolParser, tool_parser
from pagellm.entrypoints.openai.tool_calls.prompt import template_renders_tools, write_tools_in
from pagellm.model.tokenizer import read_chat_template
from pagellm.structured_output.grammar import llguidance_tokenizer
from tests.helpers.server import MODEL_NAME

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "parameters": {}}  # no arguments: the call's arguments are {}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


# ---- formats ---------------------------------------------------------------------------------


def test_hermes_calls_and_content() -> None:
    extracted = HermesToolParser().extract(HERMES_TEXT)
    assert extracted.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]
    assert len({c.id for c in extracted.calls}) == 2 and all(c.id.startswith("call_") for c in extracted.calls)
    not_a_call = "<tool_call>\n{not json}\n</tool_call>"
    assert HermesToolParser().extract(not_a_call).content == not_a_call  # left as text
    assert HermesToolParser().extract("plain").calls == []


def test_llama3_json_calls() -> None:
    parser = Llama3JsonToolParser()
    extracted = parser.extract('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "f", "parameters": {"a": 1}}')
    assert extracted.content is None and [(c.name, c.arguments) for c in extracted.calls] == [
        ("get_time", "{}"), ("f", '{"a": 1}')]
    assert parser.extract('Sure: {"name": "f"}').calls == []
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, llama3_json"):
        tool_parser("mistral")


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("text", [
    HERMES_TEXT, "no calls, a trailing space ", "  <tool_call>\n{bad}\n</tool_call> tail", "<tool_c",
    'A\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nB', '{"name": "get_time", "parameters": {}}',
    '{"name": "unfinished',
])  # fmt: skip
def test_streamed_equals_whole(parser, text: str) -> None:
    whole = parser.extract(text)
    for step in (1, 2, 5, 64):
        streamer = parser.streamer()
        pieces = [streamer.feed(text[i : i + step], final=i + step >= len(text)) for i in range(0, len(text), step)]
        content = "".join(p.content for p in pieces)
        assert (content or None) == whole.content, (step, content)
        assert _reassembled([d for p in pieces for d in p.deltas]) == [(c.name, c.arguments) for c in whole.calls]


def _reassembled(deltas: list) -> list[tuple[str, str]]:
    """Streamed call pieces joined per call, in the order the calls started (a start first)."""
    calls: dict[str, list[str]] = {}
    for delta in deltas:
        if delta.name is not None:
            assert delta.call_id not in calls
            calls[delta.call_id] = [delta.name, delta.arguments]
        else:
            calls[delta.call_id][1] += delta.arguments
    return [(name, arguments) for name, arguments in calls.values()]


def test_hermes_arguments_stream_as_they_are_written() -> None:
    """The call starts once its head is written, and each token's worth of arguments follows
    at once; the pieces are the model's text, which the whole answer returns too."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "c"}}\n</tool_call>'
    streamer = HermesToolParser().streamer()
    seen = []
    for i in range(len(text)):
        for delta in streamer.feed(text[i], final=i == len(text) - 1).deltas:
            seen.append((i, delta))
    start_at = text.index('"arguments": ') + len('"arguments": ')
    assert seen[0][1].name == "get_weather" and seen[0][0] == start_at  # at the argument's first character
    arguments = [d.arguments for _, d in seen[1:]]
    assert all(len(a) == 1 for a in arguments)  # one character in, one out
    assert "".join(arguments) == '{"city": "Pa\\"ris}", "unit": "c"}'  # brackets in strings do not end it
    [whole] = HermesToolParser().extract(text).calls
    assert whole.arguments == "".join(arguments) and json.loads(whole.arguments) == {"city": 'Pa"ris}', "unit": "c"}
    # A body of another shape (keys in the other order) is released whole at its end.
    other = '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>'
    streamer = HermesToolParser().streamer()
    pieces = [streamer.feed(c, final=False) for c in other]
    assert all(not p.deltas for p in pieces[:-1]) and _reassembled(pieces[-1].deltas) == [("get_time", "{}")]


@pytest.mark.parametrize("parser", [HermesToolParser(), Llama3JsonToolParser()], ids=["hermes", "llama3_json"])
def test_the_grammar_takes_valid_calls_only(parser, default_tokenizer) -> None:
    tokenizer = llguidance_tokenizer(default_tokenizer, len(default_tokenizer), default_tokenizer.eos_token_id)
    grammar = LLMatcher.grammar_from_lark(parser.grammar([WEATHER, TIME], parallel=False))
    args_key = "arguments" if parser.name == "hermes" else "parameters"

    def accepts(call: dict) -> bool:
        body = json.dumps(call)
        text = f"<tool_call>\n{body}\n</tool_call>" if parser.name == "hermes" else body
        matcher = LLMatcher(tokenizer, grammar)
        return matcher.consume_tokens(default_tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts({"name": "get_weather", args_key: {"city": "Paris", "unit": "c"}})
    assert accepts({"name": "get_time", args_key: {}})
    assert not accepts({"name": "get_weather", args_key: {"city": "Paris"}})  # unit is required
    assert not accepts({"name": "get_stock", args_key: {}})


def test_templates_without_tools_get_them_written_in() -> None:
    assert template_renders_tools("{% if tools %}{{ tools }}{% endif %}")
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
    ]  # fmt: skip
    written = write_tools_in(history, [WEATHER])
    assert [m["role"] for m in written] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in written[0]["content"] and "<tool_call>" in written[0]["content"]
    assert written[2]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert written[3]["content"] == "<tool_response>\n12:00\n</tool_response>"
    assert write_tools_in([{"role": "system", "content": "Be brief."}], [TIME])[0]["content"].startswith("Be brief.\n\n")


# ---- over HTTP ---------------------------------------------------------------------------------

# The tools prompt takes ~210 of the tiny server's 256 tokens; one call fits in the rest.
GREEDY = dict(temperature=0.0, max_tokens=42, parallel_tool_calls=False)


def _check_call(call, schema: dict) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.slow
def test_required_gives_valid_calls(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, WEATHER["parameters"] if call.function.name == "get_weather" else {"type": "object", "maxProperties": 0})


@pytest.mark.slow
def test_a_named_function_is_called(client: openai.OpenAI) -> None:
    for name, schema in (("get_weather", WEATHER["parameters"]), ("get_time", {"type": "object", "maxProperties": 0})):
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, **GREEDY,
            tool_choice={"type": "function", "function": {"name": name}},
        )  # fmt: skip
        [call] = result.choices[0].message.tool_calls
        assert call.function.name == name and result.choices[0].finish_reason == "tool_calls"
        _check_call(call, schema)


@pytest.mark.slow
def test_streamed_calls_reassemble_to_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", **GREEDY)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    assert not entry["name"] and not entry["arguments"]  # the name comes first
                    entry["name"] = delta.function.name
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


@pytest.mark.slow
def test_tool_results_in_the_history_are_rendered(client: openai.OpenAI) -> None:
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]  # fmt: skip
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert result.choices[0].message.tool_calls == [] and result.choices[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "not several"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
          "tool_choice": "required"}, "tool_choice", "does not compile"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "messages", "is not valid JSON"),
    ],
)
def test_tool_requests_that_cannot_work_are_400s(http: httpx.Client, extra: dict, param: str, message: str) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("with_system", [True, False])
def test_the_shipped_chatml_tools_template_renders_what_pagellm_writes(default_tokenizer, with_system: bool) -> None:
    """--chat-template chatml-tools renders a tool conversation exactly as pagellm writes it into
    the default model's own ChatML template."""
    conversation = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "1"},
        {"role": "tool", "content": "21 C", "tool_call_id": "2"},
    ]  # fmt: skip
    if with_system:
        conversation.insert(0, {"role": "system", "content": "Be brief."})
    shipped = default_tokenizer.apply_chat_template(
        conversation, tools=TOOLS, chat_template=read_chat_template("chatml-tools"), tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    written = default_tokenizer.apply_chat_template(
        write_tools_in(conversation, [t["function"] for t in TOOLS]), tokenize=False, add_generation_prompt=True
    )
    assert shipped == written and template_renders_tools(read_chat_template("chatml-tools"))
    assert "<tool_response>\n21 C\n</tool_response>" in shipped and shipped.endswith("<|im_start|>assistant\n")
