"""POST /v1/chat/completions: a conversation rendered by the chat template, ``n`` answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.media import MediaPolicy
from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    DeltaMessage,
)
from pagellm.entrypoints.openai.reasoning import ReasoningParser, ReasoningStreamer
from pagellm.entrypoints.openai.serving_models import ServedModels
from pagellm.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    ChoiceDelta,
    ChoiceTracker,
    OpenAIServing,
    PerChoice,
    accumulate,
    collect_answer,
    guard_sse,
    json_logprob,
    merge_async_iterators,
    new_request_id,
    sse_event,
)
from pagellm.entrypoints.openai.tool_calls.output import ChoiceToolStream, finish_reason_with_calls, tool_calls_out
from pagellm.entrypoints.openai.tool_calls.parsers import HermesToolParser, ToolParser
from pagellm.entrypoints.openai.tool_calls.prompt import template_renders_tools, write_tools_in
from pagellm.entrypoints.openai.tool_calls.request import ToolPlan, plan_tools
from pagellm.outputs import Logprob, PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_n: int) -> ChatLogProbs:
    """Chat-format logprobs: each token with its bytes and its ``top_n`` most likely alternatives."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) or next(iter(position.values()))
        ranked = sorted(
            (lp for lp in position.values() if lp.rank is not None and lp.rank <= top_n), key=lambda lp: lp.rank or 0
        )
        content.append(
            ChatLogProbsContent(**_chat_logprob(chosen).model_dump(), top_logprobs=[_chat_logprob(lp) for lp in ranked])
        )
    return ChatLogProbs(content=content)


def _chat_logprob(logprob: Logprob) -> ChatLogProb:
    token = logprob.decoded_token or ""
    return ChatLogProb(token=token, logprob=json_logprob(logprob.logprob), bytes=list(token.encode("utf-8")))


# apply_chat_template's own arguments and the inputs other request fields own: a client may not
# set them through chat_template_kwargs (e.g. ``tools`` would pass the tools check below).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def check_template_kwargs(template_kwargs: dict[str, Any] | None, trust_request_chat_template: bool) -> dict[str, Any]:
    """The client's extra template variables; a template of its own only if the operator allows it.

    A chat template is a program: a client-supplied one can loop for hours or build gigabyte
    strings inside the server, so it is refused unless ``--trust-request-chat-template`` is set.
    """
    kwargs = dict(template_kwargs or {})
    template = kwargs.get("chat_template")
    if template is not None:
        if not trust_request_chat_template:
            raise BadRequestError(
                "a chat template sent with the request is refused: the server does not trust request chat "
                "templates (start it with --trust-request-chat-template to allow them)",
                param="chat_template_kwargs",
            )
        if not isinstance(template, str):
            raise BadRequestError("chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs) - {"chat_template"})
    if reserved:
        raise BadRequestError(
            f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own fields",
            param="chat_template_kwargs",
        )
    return kwargs


@dataclass(frozen=True)
class Conversation:
    """A conversation as a request gives it to the chat template: its messages and the
    template's options (``template_kwargs`` must have passed ``check_template_kwargs``;
    ``functions``: the tools shown to the model)."""

    messages: list[ChatMessageParam]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    functions: list[dict[str, Any]] | None = None

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        return [url for message in self.messages for url in message.image_urls]


def render_messages(serving: OpenAIServing, conversation: Conversation) -> list[int]:
    """The conversation through the model's chat template, tokenized (:func:`render_conversation`)."""
    text = render_conversation(serving, conversation)
    return list(serving.engine.input_processor.tokenizer(text, add_special_tokens=False).input_ids)


def render_conversation(serving: OpenAIServing, conversation: Conversation) -> str:
    """The conversation through the model's chat template; template failures are the client's 400.

    The tools (``functions``) go to a template that renders tools, else are written into the
    conversation (``tool_calls.prompt``). An image part renders as the ``<image>`` placeholder.
    Slow for long conversations: callers on the event loop run it in a worker thread.
    """
    messages, add_generation_prompt = conversation.messages, conversation.add_generation_prompt
    continue_final_message, template_kwargs = conversation.continue_final_message, conversation.template_kwargs
    functions = conversation.functions
    if not messages:
        raise BadRequestError("messages must be a non-empty list", param="messages")
    processor = serving.engine.input_processor
    if len(messages) > processor.max_model_len:  # every message renders to at least one token
        raise BadRequestError(
            f"messages holds {len(messages)} messages, more than fit in max_model_len={processor.max_model_len} tokens",
            param="messages",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise BadRequestError("continue_final_message needs the last message to be from the assistant",
                              param="continue_final_message")
    template = template_kwargs.get("chat_template") or processor.tokenizer.chat_template
    try:
        dicts = [m.to_template_dict() for m in messages]
        has_tool_history = any(d["role"] == "tool" or d.get("tool_calls") for d in dicts)
        if functions or has_tool_history:
            if template_renders_tools(template):
                if functions:
                    tools = [{"type": "function", "function": f} for f in functions]
                    template_kwargs = {**template_kwargs, "tools": tools}
            else:
                dicts = write_tools_in(dicts, functions or [])
    except ValueError as exc:
        raise BadRequestError(str(exc), param="messages") from exc
    total_chars = sum(len(m["content"]) if isinstance(m["content"], str) else
                      sum(len(part.get("text", "")) for part in m["content"]) for m in dicts)  # fmt: skip
    if total_chars > processor.max_prompt_chars:
        raise BadRequestError(
            f"the messages hold {total_chars} characters, more than can fit in max_model_len="
            f"{processor.max_model_len} tokens",
            param="messages",
        )
    try:
        return processor.render_chat(
            dicts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise BadRequestError(f"cannot apply the chat template to these messages: {exc}", param="messages") from exc


def conversation_with_images(serving: OpenAIServing, conversation: Conversation) -> ProcessedPrompt:
    """A conversation whose messages hold images: rendered, each image's placeholder expanded
    into its tokens (every refusal a 400 on ``messages``)."""
    messages = conversation.messages
    processor = serving.engine.input_processor
    if processor.images is None:
        raise BadRequestError("this model takes no images: image_url parts need a vision-language model",
                              param="messages")  # fmt: skip
    for index, message in enumerate(messages):
        if message.role != "user" and message.image_urls:
            raise BadRequestError(f"messages[{index}] is a {message.role} message with images: images go in user "
                                  "messages", param=f"messages[{index}].content")  # fmt: skip
    images = serving.images_of(conversation.image_urls, "messages")
    text = render_conversation(serving, conversation)
    try:
        return processor.process_images(text, {"image": images}, add_special_tokens=False)
    except ValueError as exc:
        raise BadRequestError(str(exc), param="messages") from exc


@dataclass
class _Context:
    request: ChatCompletionRequest
    request_id: str
    model: str
    created: int
    tools: ToolPlan
    reasoning: ReasoningParser | None  # the answers' thinking split off (--reasoning-parser)

    @property
    def top_n(self) -> int | None:
        """None: no logprobs; otherwise how many alternatives per token."""
        return (self.request.top_logprobs or 0) if self.request.logprobs else None


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLMEngine,
        models: ServedModels | list[str],
        trust_request_chat_template: bool = False,
        tool_parser: ToolParser | None = None,
        auto_tool_choice: bool = True,
        reasoning_parser: ReasoningParser | None = None,
        constrain_thinking: bool = False,
        media: MediaPolicy = MediaPolicy(),
    ) -> None:
        super().__init__(engine, models, media=media)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser if tool_parser is not None else HermesToolParser()
        self.auto_tool_choice = auto_tool_choice
        self.reasoning_parser = reasoning_parser
        # A reasoning model's constraints (response formats, forced tool calls) apply after its
        # thinking, unless ``constrain_thinking`` (--structured-outputs-config enable_in_reasoning).
        self.constraint_thinking = (
            reasoning_parser.constraint_thinking if reasoning_parser is not None and not constrain_thinking else None
        )

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_alive()
        model, lora = self.resolve(request.model)
        # Checking options, compiling a constraint, rendering and tokenizing take a while for big
        # requests: all of it off the event loop, so that every other route keeps answering.
        tools, params, prompt = await asyncio.to_thread(self.prepare, request)
        ctx = _Context(request, new_request_id("chatcmpl"), model, int(time.time()), tools, self.reasoning_parser)

        tracker = ChoiceTracker(n=request.n, prompt_tokens=len(prompt.prompt_token_ids))
        merged = merge_async_iterators(self.generators([prompt], params, ctx.request_id, priority=request.priority,
                                                       lora=lora))  # fmt: skip
        if request.stream:
            return StreamingResponse(guard_sse(self._stream(ctx, merged, tracker)), media_type="text/event-stream")
        items = await collect_answer(merged, raw_request)
        if items is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self._response(ctx, tracker, items).model_dump())

    def prepare(
        self, request: ChatCompletionRequest
    ) -> tuple[ToolPlan, SamplingParams | BeamSearchParams, ProcessedPrompt]:
        """Everything between the parsed body and the engine, cheapest checks first (a worker thread)."""
        _check_chat_options(request, self.engine.input_processor.limits.max_logprobs)
        if self.reasoning_parser is not None and self.reasoning_parser.keeps_special_tokens:
            request = request.model_copy(update={"skip_special_tokens": False})  # (harmony's markers)
        tools = plan_tools(request, self.tool_parser, self.auto_tool_choice)
        max_tokens = request.effective_max_tokens
        top_n = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, top_n, tool_constraint=tools.constraint,
                                      thinking=self.constraint_thinking)  # fmt: skip
        template_kwargs = check_template_kwargs(request.chat_template_kwargs, self.trust_request_chat_template)
        prompt = self._prompt(request, template_kwargs, tools.functions)
        self.check_length(len(prompt.prompt_token_ids), max_tokens, "messages")
        return tools, params, prompt

    def _prompt(
        self, request: ChatCompletionRequest, template_kwargs: dict[str, Any], functions: list[dict[str, Any]]
    ) -> ProcessedPrompt:
        conversation = Conversation(request.messages, request.add_generation_prompt, request.continue_final_message,
                                    template_kwargs, functions)  # fmt: skip
        if not conversation.image_urls:
            ids = render_messages(self, conversation)
            return self.process_prompt({"prompt_token_ids": ids}, "messages", request.cache_salt)
        prompt = conversation_with_images(self, conversation)
        prompt.cache_salt = request.cache_salt
        return prompt

    @staticmethod
    def _logprobs(ctx: _Context, token_ids: list[int], positions: list[PositionLogprobs] | None) -> ChatLogProbs | None:
        if ctx.top_n is None:
            return None
        return chat_logprobs(token_ids, positions or [], ctx.top_n)

    def _response(
        self, ctx: _Context, tracker: ChoiceTracker, items: list[tuple[int, RequestOutput]]
    ) -> ChatCompletionResponse:
        results, _ = accumulate(tracker, items, 1)
        choices = []
        for r in results:
            text, reasoning = r.text, None
            if ctx.reasoning is not None:  # calls are parsed from the answer after the thinking
                split = ctx.reasoning.split(text)
                text, reasoning = split.content, split.reasoning
            message, finish_reason = ChatMessage(role="assistant", content=text), r.finish_reason
            if ctx.tools.parser is not None:
                extracted = ctx.tools.parser.extract(text)
                message = ChatMessage(content=extracted.content, tool_calls=tool_calls_out(extracted.calls))
                finish_reason = finish_reason_with_calls(r.finish_reason, bool(extracted.calls))
            if reasoning and ctx.request.include_reasoning:  # (an empty thinking streams nothing either)
                message.reasoning = message.reasoning_content = reasoning
                message.content = message.content or None
            choices.append(ChatChoice(
                index=r.index, message=message, logprobs=self._logprobs(ctx, r.token_ids, r.logprobs),
                finish_reason=finish_reason, stop_reason=r.stop_reason,
            ))  # fmt: skip
        return ChatCompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=tracker.usage()
        )

    async def _stream(
        self, ctx: _Context, merged: AsyncIterator[tuple[int, RequestOutput]], tracker: ChoiceTracker
    ) -> AsyncIterator[str]:
        exclude = None if ctx.request.include_usage else {"usage"}
        # As OpenAI: every choice opens with the assistant role, before any content.
        for index in range(ctx.request.n):
            role_choice = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield sse_event(self._chunk(ctx, [role_choice]), exclude)
        parser = ctx.tools.parser
        tool_streams = PerChoice(lambda: ChoiceToolStream(parser.streamer())) if parser is not None else None
        thinking = PerChoice(ctx.reasoning.streamer) if ctx.reasoning is not None else None
        async for _, output in merged:
            for delta in tracker.deltas(0, output):
                for choice in self._stream_choices(ctx, delta, tool_streams, thinking):
                    yield sse_event(self._chunk(ctx, [choice]), exclude)
        if ctx.request.include_usage:
            yield sse_event(self._chunk(ctx, [], tracker))

    @staticmethod
    def _chunk(
        ctx: _Context, choices: list[ChatStreamChoice], tracker: ChoiceTracker | None = None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
            usage=tracker.usage() if tracker is not None else None,
        )

    def _stream_choices(
        self, ctx: _Context, delta: ChoiceDelta, tool_streams: PerChoice[ChoiceToolStream] | None,
        thinking: PerChoice[ReasoningStreamer] | None = None,
    ) -> list[ChatStreamChoice]:
        """The chunks' choices for one delta: its thinking (with a reasoning parser), its text
        (what is surely not part of a call, when calls are parsed), then each completed call
        (name, then arguments); the last one carries the finish reason. None at all when there is
        nothing to send."""
        text, call_chunks, finish_reason = delta.text, [], delta.finish_reason
        choices = []
        if thinking is not None:
            reasoning, text = thinking.of(delta.index).feed(text, final=delta.finish_reason is not None)
            if reasoning and ctx.request.include_reasoning:
                choices.append(ChatStreamChoice(index=delta.index,
                                                delta=DeltaMessage(reasoning=reasoning, reasoning_content=reasoning)))  # fmt: skip
        if tool_streams is not None:
            stream = tool_streams.of(delta.index)
            text, call_chunks = stream.feed(text, final=delta.finish_reason is not None)
            finish_reason = finish_reason_with_calls(delta.finish_reason, stream.num_calls > 0)
        logprobs = self._logprobs(ctx, delta.token_ids, delta.logprobs)
        has_logprobs = logprobs is not None and bool(logprobs.content)
        if text or has_logprobs:
            choices.append(ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=text), logprobs=logprobs))
        choices.extend(
            ChatStreamChoice(index=delta.index, delta=DeltaMessage(tool_calls=calls)) for calls in call_chunks
        )
        if finish_reason is not None:
            if not choices:
                choices.append(ChatStreamChoice(index=delta.index, delta=DeltaMessage()))
            choices[-1].finish_reason, choices[-1].stop_reason = finish_reason, delta.stop_reason
        return choices


def _check_chat_options(request: ChatCompletionRequest, max_logprobs: int) -> None:
    """Options OpenAI defines that this server does not implement, or that contradict each other."""
    if request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= max_logprobs:
            raise BadRequestError(
                f"top_logprobs must be between 0 and {max_logprobs}, got {request.top_logprobs}.", param="top_logprobs"
            )
        if request.top_logprobs > 0 and not request.logprobs:
            raise BadRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
