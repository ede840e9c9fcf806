"""Pydantic models of the OpenAI wire format (plus vLLM's extension fields).

Requests ignore unknown fields, as OpenAI and vLLM do, so newer clients keep working; types
are checked here, value ranges by ``SamplingParams`` so each rule lives in one place.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, model_serializer, model_validator

from pagellm.bounded_json import parse_json_text
from pagellm.engine.input_processor import check_text

TokenIds = list[StrictInt]


class OpenAIBaseModel(BaseModel):
    # allow_inf_nan=False: JSON's non-standard Infinity/NaN (which Python's parser accepts) are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_TEXT_OR_CONTAINER = (str, dict, list)


def _check_strings(body: Any) -> Any:
    """Every string of a request body (keys too) must be valid Unicode: JSON escapes can carry
    lone surrogates, which no tokenizer, template or JSON encoder downstream accepts."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # iterative: a deeply nested body must not exhaust the recursion limit
        path, value = stack.pop()
        if isinstance(value, str):
            check_text(value, path or "the request body")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    check_text(key, f"a key in {path or 'the request body'}")
                stack.append((f"{path}.{key}".lstrip("."), item))
        elif isinstance(value, list):  # only text and containers are visited: token-id lists are long
            stack.extend(
                (f"{path}[{i}]", item) for i, item in enumerate(value) if isinstance(item, _TEXT_OR_CONTAINER)
            )
    return body


# Validation context key: True when the body's raw text was seen to hold no surrogate escape, so
# that no string in it can be invalid (request_body.decode_body) and the walk is skipped.
TEXT_CHECKED = "text_checked"


class RequestBody(OpenAIBaseModel):
    """A top-level request: its raw JSON is checked for invalid text once, before field validation."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any, info: ValidationInfo) -> Any:
        if info.context and info.context.get(TEXT_CHECKED):
            return data
        return _check_strings(data)


# ---- requests ----------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema`` as OpenAI defines it."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request object (exactly one kind; checked when converted)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(RequestBody):
    """The fields /v1/completions and /v1/chat/completions share (both become SamplingParams)."""

    model: str | None = None  # None: the first served model name (as vLLM)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # keeps this request's prefix-cache entries apart (per tenant)
    priority: int = 0  # with --scheduling-policy priority: lower first
    use_beam_search: bool = False  # n becomes the beam width; the n best beams are the choices
    length_penalty: float = 1.0  # beam search: score = cum_logprob / generated_len ** length_penalty
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields (at most one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    # Text, several texts, token ids, or several token-id lists: one prompt per entry.
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIBaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # (accepted; the model's processor decides)


class ImageContentPart(OpenAIBaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextContentPart | ImageContentPart, Field(discriminator="type")]


class FunctionCallParam(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallParam(OpenAIBaseModel):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers
    reasoning_content: str | None = None  # assistant messages: their thinking (templates may render it)
    reasoning: str | None = None

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageContentPart)]

    def to_template_dict(self) -> dict[str, Any]:
        """The plain dict chat templates expect; text parts are joined as vLLM does, parts with
        images kept as ``{"type": "text" | "image"}`` parts (the input processor gives them to
        the template as it takes them: ``content_as_template_takes``); earlier calls' arguments
        are parsed (templates render them as JSON objects)."""
        content: Any
        if isinstance(self.content, list) and self.image_urls:
            content = [{"type": "text", "text": part.text} if isinstance(part, TextContentPart) else {"type": "image"}
                       for part in self.content]  # fmt: skip
        elif isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content if isinstance(part, TextContentPart))
        else:
            content = self.content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None:
            message["reasoning_content"] = thinking
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_object(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        return message


def _json_object(text: str) -> dict[str, Any]:
    """A call's arguments as an object; ValueError (a 400) when they are not a JSON object's text."""
    arguments = parse_json_text(text, "tool call arguments")
    if not isinstance(arguments, dict):
        raise ValueError(f"tool call arguments must be a JSON object, got {type(arguments).__name__} {text[:80]!r}")
    return arguments


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True
    # vLLM extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: false drops the thinking from the answer

    @property
    def effective_max_tokens(self) -> int | None:
        """``max_completion_tokens`` is the newer name and wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: either ``prompt`` (text) or ``messages`` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: TokenIds


# ---- responses -----------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE event; OpenAI uses the same ``object`` for chunks of text completions."""


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCallOut(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # The thinking of a reasoning model (--reasoning-parser), under both names clients read.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_reasoning(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.reasoning is None:
            data.pop("reasoning", None)
            data.pop("reasoning_content", None)
        return data


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of call ``index``: its id, type and name first, then its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI deltas only carry what changed: {"role": ...} first, then {"content": ...}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    """A served model, as OpenAI's clients read it and (``type``, ``display_name``,
    ``created_at``) as Anthropic's do."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    type: Literal["model"] = "model"
    display_name: str = ""
    created_at: str = ""

    @model_validator(mode="after")
    def _anthropic_fields(self) -> ModelCard:
        self.display_name = self.display_name or self.id
        if not self.created_at:
            self.created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))
        return self


class ModelList(OpenAIBaseModel):
    """OpenAI's list, with Anthropic's page fields (one page: every served name)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @model_validator(mode="after")
    def _page(self) -> ModelList:
        if self.data:
            self.first_id, self.last_id = self.data[0].id, self.data[-1].id
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
