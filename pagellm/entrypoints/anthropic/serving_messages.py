"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request becomes the chat request that serves it (``to_chat.py``): the same template, tool
prompt and grammar, sampling checks and engine calls as ``/v1/chat/completions``. What comes
back is Anthropic's: content blocks (``thinking`` with a reasoning parser, ``text``, ``tool_use``
with its input as an object), a ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``
with the sequence, ``tool_use``), usage in input and output tokens; streamed as Anthropic's
events (``message_start``, each block's ``content_block_start`` / ``content_block_delta``
(``thinking_delta``, ``text_delta``, ``input_json_delta``) / ``content_block_stop``,
``message_delta`` with the stop reason and usage, ``message_stop``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.anthropic.errors import anthropic_sse_error
from pagellm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    Usage,
    new_message_id,
    new_tool_use_id,
)
from pagellm.entrypoints.anthropic.to_chat import to_chat_request
from pagellm.entrypoints.openai.answer_stream import AnswerStream
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    ChoiceTracker,
    accumulate,
    collect_answer,
    guard_sse,
    merge_async_iterators,
)
from pagellm.entrypoints.openai.tool_calls.parsers import FunctionCall


def stop_reason(finish_reason: str | None, matched: int | str | None, has_calls: bool) -> tuple[StopReason, str | None]:
    """Anthropic's stop reason (and the stop sequence met) for the engine's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def tool_use(call: FunctionCall) -> ToolUseOut:
    """A parsed call as a ``tool_use`` block (its arguments, a JSON object's text, as the object)."""
    arguments = json.loads(call.arguments) if call.arguments else {}
    return ToolUseOut(id=new_tool_use_id(), name=call.name, input=arguments if isinstance(arguments, dict) else {})


def shows_thinking(request: MessagesRequest) -> bool:
    """Whether the answer shows a reasoning model's thinking (all but ``thinking: disabled``)."""
    return request.thinking is None or request.thinking.type == "enabled"


def sse(name: str, data: dict[str, Any]) -> str:
    """One event as Anthropic frames them: its name, then its JSON."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    """The Messages routes, served by the chat path's pieces (``chat``)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat = self.chat
        chat.check_alive()
        model, lora = chat.resolve(request.model)
        chat_request = await asyncio.to_thread(to_chat_request, request, model)
        tools, params, prompt = await asyncio.to_thread(chat.prepare, chat_request)
        message_id = new_message_id()
        tracker = ChoiceTracker(n=1, prompt_tokens=len(prompt.prompt_token_ids))
        merged = merge_async_iterators(chat.generators([prompt], params, message_id, lora=lora))
        if request.stream:
            answer = AnswerStream(chat.reasoning_parser, tools.parser)
            stream = _Stream(message_id, model, tracker, answer, shows_thinking(request))
            guarded = guard_sse(stream.events(merged), lambda error: anthropic_sse_error(error.status_code, error.message),
                                done=None)  # fmt: skip
            return StreamingResponse(guarded, media_type="text/event-stream")
        items = await collect_answer(merged, raw_request)
        if items is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        (result,), _ = accumulate(tracker, items, 1)
        content: list[ThinkingOut | TextOut | ToolUseOut] = []
        text, calls = result.text, []
        if chat.reasoning_parser is not None:  # the thinking first; calls are parsed from the rest
            split = chat.reasoning_parser.split(text)
            text = split.content
            if split.reasoning and shows_thinking(request):  # (an empty thinking streams no block either)
                content.append(ThinkingOut(thinking=split.reasoning))
        if tools.parser is not None:
            extracted = tools.parser.extract(text)
            text, calls = extracted.content or "", extracted.calls
        if text:
            content.append(TextOut(text=text))
        content.extend(tool_use(call) for call in calls)
        reason, sequence = stop_reason(result.finish_reason, result.stop_reason, bool(calls))
        usage = Usage(input_tokens=tracker.prompt_tokens, output_tokens=tracker.completion_tokens)
        response = MessageResponse(id=message_id, model=model, content=content, stop_reason=reason,
                                   stop_sequence=sequence, usage=usage)  # fmt: skip
        return JSONResponse(response.model_dump())

    async def count_tokens(self, request: CountTokensRequest) -> JSONResponse:
        """The prompt's tokens as ``/v1/messages`` would render it (tools included)."""
        chat = self.chat
        chat.check_alive()
        model = chat.resolve_model(request.model)

        def count() -> int:
            _, _, prompt = chat.prepare(to_chat_request(request, model, max_tokens=1))
            return len(prompt.prompt_token_ids)

        return JSONResponse(CountTokensResponse(input_tokens=await asyncio.to_thread(count)).model_dump())


@dataclass
class _Stream:
    """One streamed message: the block open now (its index and kind) and the calls' parser."""

    message_id: str
    model: str
    tracker: ChoiceTracker
    answer: AnswerStream  # the thinking, the text and the calls of the answer
    show_thinking: bool = True
    index: int = -1
    open_kind: str | None = None
    num_calls: int = 0
    call_ids: dict[str, str] = field(default_factory=dict)  # the parser's call id -> the tool_use id

    async def events(self, merged: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
        message = MessageResponse(id=self.message_id, model=self.model, content=[], stop_reason=None,
                                  usage=Usage(input_tokens=self.tracker.prompt_tokens, output_tokens=0))  # fmt: skip
        yield sse("message_start", {"type": "message_start", "message": message.model_dump()})
        reason: StopReason = "end_turn"
        sequence: str | None = None
        async for _, output in merged:
            for delta in self.tracker.deltas(0, output):
                final = delta.finish_reason is not None
                for event in self._feed(delta.text, final):
                    yield event
                if final:
                    reason, sequence = stop_reason(delta.finish_reason, delta.stop_reason, self.num_calls > 0)
        for event in self._close():
            yield event
        yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": self.tracker.completion_tokens}})  # fmt: skip
        yield sse("message_stop", {"type": "message_stop"})

    def _feed(self, text: str, final: bool) -> Iterator[str]:
        """The events for a piece of the answer: its thinking, its text, then each call's start
        and arguments."""
        piece = self.answer.feed(text, final)
        if piece.reasoning and self.show_thinking:
            yield from self._block_delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                         {"type": "thinking_delta", "thinking": piece.reasoning})  # fmt: skip
        if piece.content:
            yield from self._text(piece.content)
        for call in piece.calls:
            if call.name is not None:
                yield from self._close()
                self.num_calls += 1
                self.call_ids[call.call_id] = new_tool_use_id()
                block = {"type": "tool_use", "id": self.call_ids[call.call_id], "name": call.name, "input": {}}
                yield from self._open("tool_use", block)
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _text(self, text: str) -> Iterator[str]:
        yield from self._block_delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": text})

    def _block_delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> Iterator[str]:
        """``delta`` to the open block of ``kind``, opened (as ``block``) first if another is open."""
        if self.open_kind != kind:
            yield from self._close()
            yield from self._open(kind, block)
        yield sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _open(self, kind: str, block: dict[str, Any]) -> Iterator[str]:
        self.index += 1
        self.open_kind = kind
        yield sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})

    def _close(self) -> Iterator[str]:
        if self.open_kind is not None:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open_kind = None
