"""Anthropic's Messages API through the official ``anthropic`` SDK (tiny random model: gibberish,
but real text): messages, stop reasons, streaming events, tool use forced by the grammar and sent
back over a second turn, count_tokens, and every refusal in Anthropic's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers.server import MODEL_NAME, RemoteServer

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK no longer takes sampling options (newer models fix them); the server still reads them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server: RemoteServer) -> Iterator[anthropic.Anthropic]:
    with server.anthropic_client(timeout=60.0) as c:
        yield c


def test_a_message_with_its_usage_and_stop_reason(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL_NAME, max_tokens=6, system="Be brief.", messages=ASK,
                                     extra_body=GREEDY)  # fmt: skip
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == MODEL_NAME and message.stop_reason in ("max_tokens", "end_turn")
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.usage.input_tokens > 5 and 1 <= message.usage.output_tokens <= 6
    counted = claude.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens


def test_a_stop_sequence_is_reported_as_met(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    words = [w for w in whole.split() if len(w) >= 3]
    assert words, whole
    message = claude.messages.create(model=MODEL_NAME, max_tokens=24, messages=ASK, extra_body=GREEDY,
                                     stop_sequences=[words[len(words) // 2]])  # fmt: skip
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == words[len(words) // 2]
    assert whole.startswith(message.content[0].text) if message.content else True


def test_streamed_events_add_up_to_the_message(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL_NAME, max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_call_then_its_result_over_two_turns(claude: anthropic.Anthropic) -> None:
    """tool_choice names the tool: the grammar makes a valid call; streamed, its input_json
    deltas build the same input; the result goes back in a second turn."""
    forced = {"type": "tool", "name": "get_weather"}
    message = claude.messages.create(model=MODEL_NAME, max_tokens=56, messages=ASK, tools=[WEATHER],
                                     tool_choice=forced, extra_body=GREEDY)  # fmt: skip
    assert message.stop_reason == "tool_use"
    (call,) = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(model=MODEL_NAME, max_tokens=56, messages=ASK, tools=[WEATHER], tool_choice=forced,
                                extra_body=GREEDY) as stream:  # fmt: skip
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert "input_json_delta" in deltas and streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                                            {"type": "text", "text": "Thanks. And tomorrow?"}]}]  # fmt: skip
    second = claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=history)
    assert second.stop_reason in ("max_tokens", "end_turn") and second.content[0].type == "text"
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=history).input_tokens
    assert second.usage.input_tokens == counted > claude.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens


def test_output_config_constrains_the_answer_to_a_schema(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    message = claude.messages.create(model=MODEL_NAME, max_tokens=40, messages=ASK,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})  # fmt: skip
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.mark.parametrize("body,status,needle", [
    ({"model": MODEL_NAME, "messages": ASK}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "max_tokens": 0, "messages": ASK}, 400, "max_tokens"),
    ({"model": "no-such-model", "max_tokens": 4, "messages": ASK}, 404, "no-such-model"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, 400, "no earlier"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, 400,
     "takes no images"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400,
     "video"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                        "name": "web_search"}]}, 400, "server tool"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool"}}, 400, "needs a name"),
    ({"model": MODEL_NAME, "max_tokens": 10**9, "messages": ASK}, 400, "maximum context length"),
    ({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}] * 100_000}, 400,
     "JSON objects and arrays"),
])  # fmt: skip
def test_refusals_in_anthropics_error_shape(http: httpx.Client, body: dict, status: int, needle: str) -> None:
    response = http.post("/v1/messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and needle in error["error"]["message"]
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_the_sdk_raises_its_own_exceptions(claude: anthropic.Anthropic, http: httpx.Client) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])  # fmt: skip
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    # Not JSON, and an unknown route under /v1/messages: the same shape.
    response = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    response = http.get("/v1/messages/nothing-here")
    assert response.status_code in (404, 405) and response.json()["type"] == "error"
    # The OpenAI routes keep OpenAI's shape.
    assert "error" in http.post("/v1/chat/completions", json={"messages": []}).json()


def test_the_key_is_taken_from_x_api_key(tiny_llama_path: str) -> None:
    key = "sk-anthropic-3"
    args = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", "32", "--max-model-len", "128"]
    with RemoteServer(tiny_llama_path, args, api_key=key) as remote:
        with remote.anthropic_client() as good:
            assert good.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK).content is not None
        with anthropic.Anthropic(base_url=remote.base_url, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                bad.messages.create(model=MODEL_NAME, max_tokens=2, messages=ASK)
        assert caught.value.body["error"]["type"] == "authentication_error"
