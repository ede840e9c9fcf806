"""``pagellm serve`` with no MODEL: the default model answers coherently, streamed and whole."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from pydantic import BaseModel, Field

from pagellm.model.default_model import DEFAULT_MODEL_NAME
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(default_model_path_fixture: str) -> Iterator[RemoteServer]:
    # default_model_path_fixture only makes sure the model package is installed (clear error if not).
    with RemoteServer(None, ["--kv-cache-memory", "64MiB"]) as remote:
        yield remote


@pytest.fixture(scope="module")
def default_client(default_server: RemoteServer) -> Iterator[openai.OpenAI]:
    with default_server.client(timeout=120.0) as client:
        yield client


def test_default_model_name(default_client: openai.OpenAI) -> None:
    assert [m.id for m in default_client.models.list().data] == [DEFAULT_MODEL_NAME]


def test_chat_answer_is_coherent(default_client: openai.OpenAI) -> None:
    # The bare question's first token is a near tie ("The" vs "L", 0.08 apart in float32), so
    # its greedy answer flips with the precision of the served path (NOTES 18); asking for a
    # sentence leaves every one of the first 8 tokens at least 0.8 ahead on every path.
    result = default_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=24,
        temperature=0.0,
    )
    answer = result.choices[0].message.content
    assert "Paris" in answer, answer
    assert result.choices[0].finish_reason in ("stop", "length")


def test_streamed_completion_matches(default_client: openai.OpenAI) -> None:
    kwargs = dict(model=DEFAULT_MODEL_NAME, prompt="The three primary colors are", max_tokens=20, temperature=0.0)
    whole = default_client.completions.create(**kwargs).choices[0].text
    streamed = "".join(
        choice.text for chunk in default_client.completions.create(stream=True, **kwargs) for choice in chunk.choices
    )
    assert streamed == whole and len(whole.split()) >= 3


class Capital(BaseModel):
    country: str
    capital: str
    # Bounded: JSON numbers may have any number of digits, and a 135M model greedily writes
    # "11111..." for an unbounded float until max_tokens.
    population_millions: int = Field(ge=0, le=2000)


def test_structured_parse_with_a_pydantic_model(default_client: openai.OpenAI) -> None:
    """The openai SDK's ``parse()``: a strict json_schema response format, parsed into the model."""
    result = default_client.chat.completions.parse(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Give the country France, its capital and its population."}],
        response_format=Capital,
        max_tokens=64,
        temperature=0.0,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital) and choice.message.parsed.capital == "Paris"


def test_a_schema_of_booleans_ends_instead_of_padding(default_client: openai.OpenAI) -> None:
    """vLLM 0.32's default lets this model pad such a schema with newlines up to max_tokens."""
    schema = {
        "type": "object",
        "properties": {k: {"type": "boolean"} for k in ("is_city", "is_large", "is_coastal")},
        "required": ["is_city", "is_large", "is_coastal"],
        "additionalProperties": False,
    }
    result = default_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Describe Paris with three booleans in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "facts", "schema": schema}},
        max_tokens=100,
        temperature=0.0,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert set(json.loads(choice.message.content or "")) == set(schema["properties"])


def test_json_object_mode(default_client: openai.OpenAI) -> None:
    result = default_client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0.0,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content or ""), dict)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def _ask_weather(client: openai.OpenAI, tool_choice: str):
    return client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0.0,
    ).choices[0]


def test_a_required_tool_call_on_the_default_model(default_client: openai.OpenAI) -> None:
    """The default model's template knows no tools: pagellm writes them into the prompt, and
    the grammar makes the model's answer one call with valid arguments."""
    choice = _ask_weather(default_client, "required")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_tool_choice_on_the_default_model(default_client: openai.OpenAI) -> None:
    """With "auto" the 135M model answers in text here (it is the model's choice); the answer
    then has no calls and ends as text does."""
    choice = _ask_weather(default_client, "auto")
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert all(c.function.name == "get_weather" for c in choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
