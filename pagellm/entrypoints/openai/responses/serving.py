"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request becomes the chat request that serves it (``to_chat.py``): the same template, tools,
grammar and checks as ``/v1/chat/completions``. The answer is split into output items: the
thinking (``reasoning``, with ``--reasoning-parser``), the text (a ``message`` with one
``output_text``), each call (``function_call``); ``status`` is ``incomplete`` (reason
``max_output_tokens``) when the answer was cut off. Streamed, each item comes as OpenAI's typed
events: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``,
its deltas (``response.reasoning_text.delta``, ``response.content_part.added`` then
``response.output_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events and ``response.output_item.done``, then ``response.completed`` (or
``response.incomplete``) with the whole response; every event numbered (``sequence_number``).
Stored responses (``store``, the default) answer GET and continue through
``previous_response_id`` (``store.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.entrypoints.openai.answer_stream import AnswerStream
from pagellm.entrypoints.openai.errors import NotFoundError, OpenAIError
from pagellm.entrypoints.openai.reasoning import ReasoningParser
from pagellm.entrypoints.openai.responses.protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)
from pagellm.entrypoints.openai.responses.store import ResponseStore
from pagellm.entrypoints.openai.responses.to_chat import conversation_of, to_chat_request
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    ChoiceTracker,
    accumulate,
    collect_answer,
    guard_sse,
    merge_async_iterators,
)
from pagellm.entrypoints.openai.tool_calls.parsers import ToolParser


def split_answer(text: str, reasoning: ReasoningParser | None, tools: ToolParser | None) -> list[OutputItem]:
    """An answer's output items: its thinking, its text, its calls (each present or not)."""
    items: list[OutputItem] = []
    if reasoning is not None:
        split = reasoning.split(text)
        text = split.content
        if split.reasoning:  # (an empty thinking streams no item either)
            items.append(OutputReasoning(id=new_id("rs"), content=[ReasoningText(type="reasoning_text",
                                                                                 text=split.reasoning)]))  # fmt: skip
    calls = []
    if tools is not None:
        extracted = tools.extract(text)
        text, calls = extracted.content or "", extracted.calls
    if text:
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=text)]))
    items.extend(OutputFunctionCall(id=new_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments) for c in calls)
    return items


def assistant_turn(items: list[OutputItem]) -> dict[str, Any]:
    """The output as one assistant message of the stored conversation."""
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    for item in items:
        if isinstance(item, OutputReasoning):
            turn["reasoning_content"] = "\n".join(p.text for p in item.content)
        elif isinstance(item, OutputMessage):
            turn["content"] = "\n".join(p.text for p in item.content)
        else:
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            turn["tool_calls"] = [*turn.get("tool_calls", []), call]
    return turn


class OpenAIServingResponses:
    """The Responses routes, served by the chat path's pieces (``chat``) and a ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, request: ResponsesRequest, raw_request: Request) -> Response:
        chat = self.chat
        chat.check_alive()
        model, lora = chat.resolve(request.model)
        previous: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self.store.get(request.previous_response_id)
            if stored is None:
                raise NotFoundError(f"no stored response {request.previous_response_id!r}: it was never stored "
                                    "(store: false), or was deleted or has expired", param="previous_response_id")  # fmt: skip
            previous = stored.conversation

        def prepare() -> tuple[list[dict[str, Any]], Any, Any, Any]:
            conversation = conversation_of(request, previous)
            return conversation, *chat.prepare(to_chat_request(request, model, conversation))

        conversation, tools, params, prompt = await asyncio.to_thread(prepare)
        response = _in_progress(request, new_id("resp"), model)
        tracker = ChoiceTracker(n=1, prompt_tokens=len(prompt.prompt_token_ids))
        merged = merge_async_iterators(chat.generators([prompt], params, response.id, priority=request.priority,
                                                       lora=lora))  # fmt: skip
        if request.stream:
            stream = _Stream(response, tracker, self, conversation, AnswerStream(chat.reasoning_parser, tools.parser))
            return StreamingResponse(guard_sse(stream.events(merged), stream.error_event, done=None),
                                     media_type="text/event-stream")  # fmt: skip
        items = await collect_answer(merged, raw_request)
        if items is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        (result,), _ = accumulate(tracker, items, 1)
        output = split_answer(result.text, chat.reasoning_parser, tools.parser)
        self.finish(response, output, result.finish_reason, tracker, conversation)
        return JSONResponse(response.model_dump())

    def finish(
        self, response: ResponseObject, output: list[OutputItem], finish_reason: str | None, tracker: ChoiceTracker,
        conversation: list[dict[str, Any]],
    ) -> None:
        """Complete ``response`` with its output and usage; store it (and its conversation) if asked."""
        response.output = output
        if finish_reason == "length":
            response.status, response.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
        else:
            response.status = "completed"
        response.usage = ResponseUsage(input_tokens=tracker.prompt_tokens, output_tokens=tracker.completion_tokens,
                                       total_tokens=tracker.prompt_tokens + tracker.completion_tokens)  # fmt: skip
        if response.store and not self.store.put(response.id, response.model_dump(), [*conversation,
                                                                                     assistant_turn(output)]):
            response.store = False  # larger than the whole store: answered, not kept

    async def get(self, response_id: str) -> JSONResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return JSONResponse(stored.response)

    async def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise NotFoundError(f"no stored response {response_id!r}", param="response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _in_progress(request: ResponsesRequest, response_id: str, model: str) -> ResponseObject:
    """The response as it starts: the request's settings echoed, no output yet."""
    choice = request.tool_choice
    return ResponseObject(
        id=response_id, status="in_progress", model=model, instructions=request.instructions,
        tools=[t.model_dump(exclude_none=True) for t in request.tools or []],
        tool_choice=choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        parallel_tool_calls=request.parallel_tool_calls, temperature=request.temperature, top_p=request.top_p,
        max_output_tokens=request.max_output_tokens, previous_response_id=request.previous_response_id,
        store=request.store, metadata=request.metadata,
        text=request.text.model_dump(by_alias=True, exclude_none=True) if request.text is not None else None,
    )  # fmt: skip


@dataclass
class _Stream:
    """One streamed response: the item open now and the parsers splitting the answer."""

    response: ResponseObject
    tracker: ChoiceTracker
    serving: OpenAIServingResponses
    conversation: list[dict[str, Any]]
    answer: AnswerStream
    sequence: int = 0
    output: list[OutputItem] = field(default_factory=list)
    open_item: OutputItem | None = None
    call_ids: dict[str, OutputFunctionCall] = field(default_factory=dict)  # the parser's call id -> its item

    def error_event(self, error: OpenAIError) -> str:
        """A failure after the start: an in-band ``error`` event, numbered as the others."""
        return self._event("error", code=error.code, message=error.message, param=error.param)

    async def events(self, merged: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.response.model_dump())
        yield self._event("response.in_progress", response=self.response.model_dump())
        finish_reason = None
        async for _, output in merged:
            for delta in self.tracker.deltas(0, output):
                final = delta.finish_reason is not None
                for event in self._feed(delta.text, final):
                    yield event
                finish_reason = delta.finish_reason or finish_reason
        for event in self._close():
            yield event
        self.serving.finish(self.response, self.output, finish_reason, self.tracker, self.conversation)
        kind = "response.completed" if self.response.status == "completed" else "response.incomplete"
        yield self._event(kind, response=self.response.model_dump())

    def _feed(self, text: str, final: bool) -> Iterator[str]:
        piece = self.answer.feed(text, final)
        if piece.reasoning:
            yield from self._reasoning(piece.reasoning)
        if piece.content:
            yield from self._text(piece.content)
        for call in piece.calls:
            if call.name is not None:
                yield from self._close()
                item = OutputFunctionCall(id=new_id("fc"), call_id=call.call_id, name=call.name, arguments="",
                                          status="in_progress")  # fmt: skip
                self.call_ids[call.call_id] = item
                yield from self._open(item)
            if call.arguments:
                item = self.call_ids[call.call_id]
                item.arguments += call.arguments
                yield self._event("response.function_call_arguments.delta", item_id=item.id,
                                  output_index=len(self.output), delta=call.arguments)  # fmt: skip

    def _reasoning(self, text: str) -> Iterator[str]:
        if not isinstance(self.open_item, OutputReasoning):
            yield from self._close()
            yield from self._open(OutputReasoning(id=new_id("rs"), content=[ReasoningText(type="reasoning_text", text="")],
                                                  status="in_progress"))  # fmt: skip
        item = self.open_item
        assert isinstance(item, OutputReasoning)
        item.content[0].text += text
        yield self._event("response.reasoning_text.delta", item_id=item.id, output_index=len(self.output),
                          content_index=0, delta=text)  # fmt: skip

    def _text(self, text: str) -> Iterator[str]:
        if not isinstance(self.open_item, OutputMessage):
            yield from self._close()
            yield from self._open(OutputMessage(id=new_id("msg"), content=[], status="in_progress"))
            item = self.open_item
            assert isinstance(item, OutputMessage)
            item.content.append(OutputText(text=""))
            yield self._event("response.content_part.added", item_id=item.id, output_index=len(self.output),
                              content_index=0, part=OutputText(text="").model_dump())  # fmt: skip
        item = self.open_item
        assert isinstance(item, OutputMessage)
        item.content[0].text += text
        yield self._event("response.output_text.delta", item_id=item.id, output_index=len(self.output),
                          content_index=0, delta=text, logprobs=[])  # fmt: skip

    def _open(self, item: OutputItem) -> Iterator[str]:
        self.open_item = item
        added = item.model_copy(deep=True)
        if isinstance(added, OutputMessage | OutputReasoning):
            added.content = []
        yield self._event("response.output_item.added", output_index=len(self.output), item=added.model_dump())

    def _close(self) -> Iterator[str]:
        item, index = self.open_item, len(self.output)
        if item is None:
            return
        item.status = "completed"
        if isinstance(item, OutputReasoning):
            yield self._event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                              text=item.content[0].text)  # fmt: skip
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            yield self._event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                              text=part.text, logprobs=[])  # fmt: skip
            yield self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                              part=part.model_dump())  # fmt: skip
        else:
            yield self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                              name=item.name, arguments=item.arguments)  # fmt: skip
        yield self._event("response.output_item.done", output_index=index, item=item.model_dump())
        self.output.append(item)
        self.open_item = None

    def _event(self, kind: str, **data: Any) -> str:
        """One event as OpenAI frames them: its type as the event's name, numbered."""
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
