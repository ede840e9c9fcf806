"""OpenAI's Responses API through the official ``openai`` SDK (tiny random model): responses and
their items, the typed event stream, stored responses continued with ``previous_response_id``
(retrieved, deleted, expired, bounded), function calls and their outputs over two turns, JSON
schema output, and every refusal as OpenAI's error object."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagellm.entrypoints.openai.responses.store import ResponseStore
from tests.helpers.server import MODEL_NAME

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False},
}  # fmt: skip
ASK = "What is the weather in Paris?"


# ---- the store ----------------------------------------------------------------------------------


def test_the_store_is_bounded_by_count_size_and_age() -> None:
    now = [0.0]
    store = ResponseStore(max_responses=2, max_chars=100, ttl_s=10.0, clock=lambda: now[0])
    turn = [{"role": "user", "content": "x" * 30}]
    assert store.put("a", {"id": "a"}, turn) and store.put("b", {"id": "b"}, turn)
    assert store.put("c", {"id": "c"}, turn)  # a third: the oldest goes
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    assert store.put("d", {"id": "d"}, [{"role": "user", "content": "y" * 80}])  # 80 + 30 > 100: b goes too
    assert store.get("b") is None and store.get("c") is None and store.get("d") is not None
    assert not store.put("e", {}, [{"role": "user", "content": "z" * 101}])  # larger than the whole store
    now[0] = 10.5
    assert store.get("d") is None and len(store) == 0  # expired
    assert store.put("f", {}, turn) and store.delete("f") and not store.delete("f")


# ---- through the server -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_response_with_its_items_and_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input=ASK, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)  # fmt: skip
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL_NAME
    assert response.status in ("completed", "incomplete") and response.output_text
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.input_tokens > 5 and 1 <= response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.slow
def test_streamed_events_build_the_same_response(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=12, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.content_part.added" in kinds and "response.output_text.delta" in kinds
    assert [event.sequence_number for event in events] == list(range(len(events)))
    # Cut off at max_output_tokens (the random model rarely ends by itself): response.incomplete.
    final = events[-1].response
    assert events[-1].type == f"response.{whole.status}" and final.status == whole.status
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


@pytest.mark.slow
def test_stored_responses_continue_and_can_be_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=6, temperature=0)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL_NAME, input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=4)  # fmt: skip
    alone = client.responses.create(model=MODEL_NAME, input="And tomorrow?", max_output_tokens=4, store=False)
    # The first turn (its question and answer) comes before the new question.
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL_NAME, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"


@pytest.mark.slow
def test_a_function_call_then_its_output_over_two_turns(client: openai.OpenAI) -> None:
    forced = {"type": "function", "name": "get_weather"}
    response = client.responses.create(model=MODEL_NAME, input=ASK, tools=[WEATHER], tool_choice=forced,
                                       max_output_tokens=56, temperature=0)  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(model=MODEL_NAME, input=ASK, tools=[WEATHER], tool_choice=forced,
                                 max_output_tokens=56, temperature=0) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [i.arguments for i in final.output if i.type == "function_call"] == [call.arguments]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}]
    after = client.responses.create(model=MODEL_NAME, input=result, previous_response_id=response.id,
                                    max_output_tokens=4)  # fmt: skip
    question = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=1, store=False)
    assert after.output and after.usage.input_tokens > question.usage.input_tokens + 10  # the call and its result
    # The same turns as items in one request, without the store.
    items = [{"role": "user", "content": ASK}, {"type": "function_call", "call_id": call.call_id,
             "name": call.name, "arguments": call.arguments}, *result]  # fmt: skip
    assert client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=4, store=False).output


@pytest.mark.slow
def test_hosted_tools_are_left_out_and_namespaces_give_their_functions(client: openai.OpenAI) -> None:
    """As Codex CLI sends them: a hosted web search (not run here: the model is not told of it)
    beside a namespace of functions, one of which the model is made to call."""
    tools = [{"type": "web_search", "external_web_access": False},
             {"type": "namespace", "name": "weather_v1", "description": "Weather tools", "tools": [WEATHER]}]
    response = client.responses.create(model=MODEL_NAME, input=ASK, tools=tools, max_output_tokens=56, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    free = client.responses.create(model=MODEL_NAME, input=ASK, tools=tools[:1], max_output_tokens=4)
    assert free.output and free.status in ("completed", "incomplete")


@pytest.mark.slow
def test_text_format_constrains_the_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    response = client.responses.create(model=MODEL_NAME, input=ASK, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("body,status,needle", [
    ({"input": ASK, "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, 400,
     "namespace holds function tools"),
    ({"input": ASK, "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"input": ASK, "tools": [{"type": "namespace", "name": f"n{i}", "tools": [{"type": "function", "name": "f"}]}
                              for i in range(2)]}, 400, "more than once"),
    ({"input": ASK, "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": f"f{i}"}
                                                                            for i in range(200)]}]}, 400, "more than the 128"),
    ({"input": ASK, "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "namespace", "name": "m"}]}]}, 400,
     "namespace holds function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}, 400,
     "input_file is not supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, 400, "no earlier"),
    ({"input": ASK, "background": True}, 400, "background"),
    ({"input": ASK, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": ASK, "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ({"input": ASK, "metadata": {"k": "v" * 513}}, 400, "metadata"),
    ({"input": ASK, "metadata": {"k" * 65: "v"}}, 400, "metadata"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "item_reference"),
    ({"input": [{"type": "no_such_item"}]}, 400, "input"),
    ({"input": ASK, "previous_response_id": "resp_missing"}, 404, "resp_missing"),
    ({"input": ASK, "model": "no-such-model"}, 404, "no-such-model"),
    ({"input": [{"role": "user", "content": "x"}] * 100_000}, 400, "JSON objects and arrays"),
])  # fmt: skip
def test_refusals_as_openai_errors(http: httpx.Client, body: dict, status: int, needle: str) -> None:
    response = http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle in str(error.get("param"))
    still = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1, "store": False})
    assert still.status_code == 200  # the server still serves


@pytest.mark.slow
def test_get_and_delete_of_an_unknown_id_are_404(http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        response = http.request(method, "/v1/responses/resp_nothing")
        assert response.status_code == 404 and "resp_nothing" in response.json()["error"]["message"]
