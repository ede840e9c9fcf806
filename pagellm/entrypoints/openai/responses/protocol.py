"""Pydantic models of OpenAI's Responses API (``/v1/responses``): the request, its input items,
and the response's output items, as the ``openai`` SDK reads them.

Unknown fields are ignored (newer clients keep working); an input item without a ``type`` is a
message (as OpenAI reads it); an unknown item or content type is a 400 naming it. Value ranges
are checked where the request becomes ``SamplingParams``; sizes by the chat path's bounds.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, RequestBody, StructuredOutputsRequest

# OpenAI's bounds on a response's metadata.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- input items --------------------------------------------------------------------------------


class InputText(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMedia(OpenAIBaseModel):
    """An image by URL (a vision-language model reads ``data:`` URLs, and those of the hosts
    ``--allowed-media-domains`` lists); files, audio and images by file id are accepted by the
    parser so that the refusal can name them."""

    type: Literal["input_image", "input_file", "input_audio"]
    image_url: str | None = None
    detail: str | None = None


class Refusal(OpenAIBaseModel):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputMedia | Refusal, Field(discriminator="type")]


class MessageItem(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = [p for p in self.content if not isinstance(p, InputMedia)]
        return "\n".join(p.text if isinstance(p, InputText) else p.refusal for p in parts)


class FunctionCallItem(OpenAIBaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(OpenAIBaseModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        return "\n".join(p.text for p in (self.content or self.summary))


class OtherItem(OpenAIBaseModel):
    """Item types this server does not serve (``item_reference``, hosted tools' calls): refused by name."""

    type: Literal["item_reference", "file_search_call", "web_search_call", "computer_call", "computer_call_output",
                  "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
                  "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
                  "custom_tool_call_output"]  # fmt: skip


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | OtherItem, Field(discriminator="type")
]


# ---- the request --------------------------------------------------------------------------------


class FunctionTool(OpenAIBaseModel):
    """A function tool, a ``namespace`` grouping function tools (``tools``), or a hosted tool
    (any other ``type``: the server does not run those)."""

    type: str
    name: str | None = Field(default=None, pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's


class NamedFunctionChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None  # effort / summary: accepted, the model decides nothing by them
    user: str | None = None
    priority: int = 0  # vLLM's extension: with --scheduling-policy priority, lower first
    # vLLM's extension, as on the chat route: a regex, grammar, choice or JSON schema.
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="before")
    @classmethod
    def _messages_without_type(cls, data: Any) -> Any:
        """An input item without a ``type`` is a message (OpenAI's easy input)."""
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = [{**i, "type": "message"} if isinstance(i, dict) and "type" not in i else i for i in data["input"]]
            data = {**data, "input": items}
        return data

    @field_validator("max_output_tokens")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {value}")
        return value

    @field_validator("metadata")
    @classmethod
    def _bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds {len(value)} keys, more than the {MAX_METADATA_KEYS} allowed")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"metadata keys hold at most {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"{MAX_METADATA_VALUE_CHARS}; {key[:40]!r} is over")  # fmt: skip
        return value


# ---- the response -------------------------------------------------------------------------------


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputReasoning(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=time.time)
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    usage: ResponseUsage | None = None
