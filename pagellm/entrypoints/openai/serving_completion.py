"""POST /v1/completions: one or more prompts, ``n`` choices each, streamed or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.detokenizer import decode_token
from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from pagellm.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    ChoiceDelta,
    ChoiceResult,
    ChoiceTracker,
    OpenAIServing,
    accumulate,
    collect_answer,
    guard_sse,
    json_logprob,
    merge_async_iterators,
    new_request_id,
    prompt_entries,
    sse_event,
)
from pagellm.outputs import PositionLogprobs, RequestOutput
from pagellm.sampling_params import SamplingParams


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    decode: Callable[[int], str],
    text_offset: int,
) -> tuple[CompletionLogProbs, int]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset).

    A position without logprobs (the first prompt token when echoing) gets None, as in
    OpenAI. Returns the logprobs and the text offset after the last token.
    """
    result = CompletionLogProbs()
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        token = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(json_logprob(chosen.logprob) if chosen is not None else None)
        result.top_logprobs.append(
            None if position is None else {(lp.decoded_token or ""): json_logprob(lp.logprob) for lp in position.values()}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


@dataclass
class _Piece:
    """A choice's text, token ids and logprob rows: the whole choice, or one streamed delta."""

    text: str
    token_ids: list[int]
    rows: list[PositionLogprobs | None]


@dataclass
class _Context:
    """Everything about one HTTP request the shaping of its choices needs."""

    request: CompletionRequest
    request_id: str
    model: str
    created: int
    prompts: list[ProcessedPrompt]
    decode: Callable[[int], str]
    decode_all: Callable[[list[int]], str]

    @property
    def want_logprobs(self) -> bool:
        return self.request.logprobs is not None

    def with_echo(self, piece: _Piece, prompt_index: int, prompt_output: RequestOutput | None) -> _Piece:
        """With ``echo``, the prompt goes in front of a choice's first piece (and its logprobs too)."""
        if not self.request.echo:
            return piece
        prompt = self.prompts[prompt_index]
        prompt_text = prompt.prompt if prompt.prompt is not None else self.decode_all(prompt.prompt_token_ids)
        if not self.want_logprobs:
            return _Piece(prompt_text + piece.text, piece.token_ids, piece.rows)
        ids = prompt.prompt_token_ids
        rows: list[PositionLogprobs | None] = list((prompt_output.prompt_logprobs if prompt_output else None) or [])
        rows += [None] * (len(ids) - len(rows))
        return _Piece(prompt_text + piece.text, ids + piece.token_ids, rows + piece.rows)

    def logprobs(self, piece: _Piece, text_offset: int) -> tuple[CompletionLogProbs | None, int]:
        if not self.want_logprobs:
            return None, text_offset
        return completion_logprobs(piece.token_ids, piece.rows, self.decode, text_offset)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_alive()
        model, lora = self.resolve(request.model)
        # Checking options, compiling a constraint and tokenizing take a while for big requests:
        # all of it off the event loop, so that every other route keeps answering.
        params, prompts = await asyncio.to_thread(self._prepare, request)

        tokenizer = self.engine.tokenizer
        ctx = _Context(
            request=request,
            request_id=new_request_id("cmpl"),
            model=model,
            created=int(time.time()),
            prompts=prompts,
            decode=lambda token_id: decode_token(tokenizer, token_id),
            decode_all=lambda ids: str(tokenizer.decode(ids)),
        )
        tracker = ChoiceTracker(n=request.n, prompt_tokens=sum(len(p.prompt_token_ids) for p in prompts))
        # best_of > n: the winners are known only at the end, so ask the engine for whole outputs.
        deltas = not isinstance(params, SamplingParams) or params.best_of is None or params.best_of <= params.n
        merged = merge_async_iterators(self.generators(prompts, params, ctx.request_id, deltas, request.priority, lora))
        if request.stream:
            return StreamingResponse(guard_sse(self._stream(ctx, merged, tracker)), media_type="text/event-stream")
        items = await collect_answer(merged, raw_request)
        if items is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self._response(ctx, tracker, items).model_dump())

    def _prepare(self, request: CompletionRequest) -> tuple[SamplingParams | BeamSearchParams, list[ProcessedPrompt]]:
        """Everything between the parsed body and the engine, cheapest checks first (a worker
        thread): the number of prompts is checked before any of them is tokenized."""
        _check_completion_options(request)
        entries = prompt_entries(request.prompt, self.max_prompts_per_request, "prompt")
        echo_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        params = self.sampling_params(
            request, request.max_tokens, request.logprobs, prompt_logprobs=echo_logprobs, best_of=request.best_of
        )
        prompts = [self._process_entry(entry, request) for entry in entries]
        for prompt in prompts:
            self.check_length(len(prompt.prompt_token_ids), request.max_tokens, "prompt")
        return params, prompts

    # ---- prompts -------------------------------------------------------------------------------

    def _process_entry(self, entry: str | list[int], request: CompletionRequest) -> ProcessedPrompt:
        if isinstance(entry, str):
            try:
                self.engine.input_processor.check_prompt_text(entry)
            except ValueError as exc:
                raise BadRequestError(str(exc), param="prompt") from exc
            ids = self.engine.tokenizer(entry, add_special_tokens=request.add_special_tokens).input_ids
            token_prompt: dict[str, Any] = {"prompt_token_ids": list(ids), "prompt": entry}
        else:
            token_prompt = {"prompt_token_ids": entry}
        return self.process_prompt(token_prompt, "prompt", request.cache_salt)

    # ---- shaping ------------------------------------------------------------------------------------

    def _response(
        self, ctx: _Context, tracker: ChoiceTracker, items: list[tuple[int, RequestOutput]]
    ) -> CompletionResponse:
        results, first_outputs = accumulate(tracker, items, len(ctx.prompts))
        choices = [self._whole_choice(ctx, r, first_outputs.get(r.prompt_index)) for r in results]
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=tracker.usage()
        )

    @staticmethod
    def _whole_choice(ctx: _Context, result: ChoiceResult, prompt_output: RequestOutput | None) -> CompletionChoice:
        piece = ctx.with_echo(_Piece(result.text, result.token_ids, list(result.logprobs or [])),
                              result.prompt_index, prompt_output)
        logprobs, _ = ctx.logprobs(piece, 0)
        return CompletionChoice(
            index=result.index, text=piece.text, logprobs=logprobs,
            finish_reason=result.finish_reason, stop_reason=result.stop_reason,
        )

    async def _stream(
        self, ctx: _Context, merged: AsyncIterator[tuple[int, RequestOutput]], tracker: ChoiceTracker
    ) -> AsyncIterator[str]:
        exclude = None if ctx.request.include_usage else {"usage"}
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        async for prompt_index, output in merged:
            for delta in tracker.deltas(prompt_index, output):
                choice = self._stream_choice(ctx, delta, output, offsets)
                if choice is not None:
                    chunk = CompletionStreamResponse(
                        id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice]
                    )
                    yield sse_event(chunk, exclude)
        if ctx.request.include_usage:
            usage_chunk = CompletionStreamResponse(
                id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=tracker.usage()
            )
            yield sse_event(usage_chunk)

    @staticmethod
    def _stream_choice(
        ctx: _Context, delta: ChoiceDelta, output: RequestOutput, offsets: dict[int, int]
    ) -> CompletionChoice | None:
        """One chunk's choice, or None when there is nothing to send (no text, no logprobs, not final)."""
        piece = _Piece(delta.text, delta.token_ids, list(delta.logprobs or []))
        if delta.first:
            piece = ctx.with_echo(piece, delta.prompt_index, output)
        logprobs, offsets[delta.index] = ctx.logprobs(piece, offsets.get(delta.index, 0))
        if not piece.text and not (logprobs and logprobs.tokens) and delta.finish_reason is None:
            return None
        return CompletionChoice(
            index=delta.index, text=piece.text, logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
        )


def _check_completion_options(request: CompletionRequest) -> None:
    if request.suffix:
        raise BadRequestError("suffix is not supported", param="suffix")
    if request.stream and request.best_of is not None and request.best_of > request.n:
        raise BadRequestError("best_of > n cannot be streamed: the best samples are known only at the end",
                              param="best_of")
