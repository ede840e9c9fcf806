"""Pydantic models of Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Requests ignore unknown fields (newer clients keep working); blocks are told apart by ``type``
and an unknown block type is a 400 naming it. Types are checked here, value ranges where the
request becomes ``SamplingParams`` (one rule, one place), sizes by the chat path's own bounds.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, RequestBody, StructuredOutputsRequest

# A tool name as Anthropic allows it.
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_.-]{1,64}$"


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class MediaSource(OpenAIBaseModel):
    """Where an image's bytes are: inline (base64) or at a URL (fetched only from the hosts
    ``--allowed-media-domains`` lists)."""

    type: str
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @property
    def data_url(self) -> str:
        """The source as one URL the chat path reads (``data:`` for inline bytes)."""
        if self.type == "base64":
            return f"data:{self.media_type or ''};base64,{self.data or ''}"
        return self.url or f"{self.type}:"


class ImageBlock(OpenAIBaseModel):
    """An image (a vision-language model reads it; a text model's refusal names it); a
    document is always refused."""

    type: Literal["image", "document"]
    source: MediaSource | None = None


class ToolUseBlock(OpenAIBaseModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenAIBaseModel):
    """The result of a call, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(OpenAIBaseModel):
    """An earlier turn's thinking, sent back as Anthropic's clients do (not shown to the model)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(OpenAIBaseModel):
    """A client tool; a server tool (with a ``type`` such as ``web_search_20250305``) is refused."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(OpenAIBaseModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class JsonOutputFormat(OpenAIBaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIBaseModel):
    """Structured outputs (``format``: the answer is JSON valid for the schema); ``effort`` is
    accepted and ignored (the model decides nothing by it)."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class MessagesRequestBase(RequestBody):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the conversation."""

    model: str | None = None
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @property
    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system


class MessagesRequest(MessagesRequestBase):
    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    # vLLM's extension, as on the OpenAI routes: a regex, grammar, choice or JSON schema.
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"max_tokens must be at least 1, got {value}")
        return value


class CountTokensRequest(MessagesRequestBase):
    pass


# ---- responses --------------------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def new_tool_use_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


class Usage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int


class TextOut(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(OpenAIBaseModel):
    """A reasoning model's thinking (``--reasoning-parser``); no signature: nothing is encrypted."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseOut(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingOut | TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int
