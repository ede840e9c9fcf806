"""POST /v1/completions: one or more prompts, ``n`` choices each, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.engine.async_engine import EngineDeadError
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
    ClientDisconnected,
    OpenAIServing,
    accumulate,
    collect_until_disconnect,
    guard_sse,
    merge_async_iterators,
    new_request_id,
    sse_event,
    to_openai_error,
)
from pagellm.outputs import PositionLogprobs, RequestOutput

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
        result.token_logprobs.append(chosen.logprob if chosen is not None else None)
        result.top_logprobs.append(
            None if position is None else {(lp.decoded_token or ""): lp.logprob for lp in position.values()}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result, text_offset


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

    def echo_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        return prompt.prompt if prompt.prompt is not None else self.decode_all(prompt.prompt_token_ids)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_alive()
        model = self.resolve_model(request.model)
        _check_completion_options(request)
        echo_logprobs = request.logprobs if request.echo and request.logprobs is not None else None
        params = self.sampling_params(request, request.max_tokens, request.logprobs, prompt_logprobs=echo_logprobs)
        prompts = self._prompts(request)
        for prompt in prompts:
            self.check_length(len(prompt.prompt_token_ids), request.max_tokens, "prompt")

        tokenizer = self.engine.tokenizer
        ctx = _Context(
            request=request,
            request_id=new_request_id("cmpl"),
            model=model,
            created=int(time.time()),
            prompts=prompts,
            decode=lambda token_id: decode_token(tokenizer, token_id),
            decode_all=lambda ids: tokenizer.decode(ids),
        )
        tracker = ChoiceTracker(n=request.n, prompt_tokens=sum(len(p.prompt_token_ids) for p in prompts))
        merged = merge_async_iterators(self.generators(prompts, params, ctx.request_id))
        if request.stream:
            return StreamingResponse(guard_sse(self._stream(ctx, merged, tracker)), media_type="text/event-stream")
        try:
            items = await collect_until_disconnect(merged, raw_request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (ValueError, EngineDeadError) as exc:
            raise to_openai_error(exc) from exc
        return JSONResponse(self._response(ctx, tracker, items).model_dump())

    # ---- prompts -------------------------------------------------------------------------------

    def _prompts(self, request: CompletionRequest) -> list[ProcessedPrompt]:
        """Normalize the four prompt forms to tokenized, checked prompts."""
        prompt = request.prompt
        if isinstance(prompt, str):
            entries: list[str | list[int]] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            entries = [prompt]  # type: ignore[list-item]
        else:
            entries = list(prompt)  # type: ignore[arg-type]
        if not entries or any(len(entry) == 0 for entry in entries):
            raise BadRequestError("prompt must not be empty", param="prompt")
        tokenizer = self.engine.tokenizer
        processed = []
        for entry in entries:
            if isinstance(entry, str):
                ids = tokenizer(entry, add_special_tokens=request.add_special_tokens).input_ids
                processed.append(self.process_prompt({"prompt_token_ids": list(ids), "prompt": entry}, "prompt"))
            else:
                processed.append(self.process_prompt({"prompt_token_ids": entry}, "prompt"))
        return processed

    # ---- shaping ------------------------------------------------------------------------------------

    @staticmethod
    def _choice(
        ctx: _Context,
        index: int,
        prompt_index: int,
        first: bool,
        text: str,
        token_ids: list[int],
        positions: list[PositionLogprobs] | None,
        prompt_output: RequestOutput | None,
        text_offset: int,
    ) -> tuple[str, CompletionLogProbs | None, int]:
        """A choice's text and logprobs; the echoed prompt goes in front of its first piece."""
        logprob_rows: list[PositionLogprobs | None] = list(positions or [])
        if first and ctx.request.echo:
            text = ctx.echo_text(prompt_index) + text
            if ctx.want_logprobs:
                prompt_rows = (prompt_output.prompt_logprobs if prompt_output else None) or []
                prompt_ids = ctx.prompts[prompt_index].prompt_token_ids
                token_ids = prompt_ids + token_ids
                logprob_rows = list(prompt_rows) + [None] * (len(prompt_ids) - len(prompt_rows)) + logprob_rows
        if not ctx.want_logprobs:
            return text, None, text_offset
        logprobs, text_offset = completion_logprobs(token_ids, logprob_rows, ctx.decode, text_offset)
        return text, logprobs, text_offset

    def _response(
        self, ctx: _Context, tracker: ChoiceTracker, items: list[tuple[int, RequestOutput]]
    ) -> CompletionResponse:
        results, first_outputs = accumulate(tracker, items, len(ctx.prompts))
        choices = [self._whole_choice(ctx, r, first_outputs.get(r.prompt_index)) for r in results]
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=tracker.usage()
        )

    def _whole_choice(self, ctx: _Context, result: ChoiceResult, prompt_output: RequestOutput | None) -> CompletionChoice:
        text, logprobs, _ = self._choice(
            ctx, result.index, result.prompt_index, True, result.text, result.token_ids, result.logprobs,
            prompt_output, 0,
        )
        return CompletionChoice(
            index=result.index, text=text, logprobs=logprobs,
            finish_reason=result.finish_reason, stop_reason=result.stop_reason,
        )

    async def _stream(
        self, ctx: _Context, merged: AsyncIterator[tuple[int, RequestOutput]], tracker: ChoiceTracker
    ) -> AsyncIterator[str]:
        exclude = None if ctx.request.include_usage else {"usage"}
        offsets: dict[int, int] = {}
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

    def _stream_choice(
        self, ctx: _Context, delta: ChoiceDelta, output: RequestOutput, offsets: dict[int, int]
    ) -> CompletionChoice | None:
        """One chunk's choice, or None when there is nothing to send (no text, no logprobs, not final)."""
        text, logprobs, offsets[delta.index] = self._choice(
            ctx, delta.index, delta.prompt_index, delta.first, delta.text, delta.token_ids, delta.logprobs,
            output, offsets.get(delta.index, 0),
        )
        has_logprobs = logprobs is not None and bool(logprobs.tokens)
        if not text and not has_logprobs and delta.finish_reason is None:
            return None
        return CompletionChoice(
            index=delta.index, text=text, logprobs=logprobs,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
        )


def _check_completion_options(request: CompletionRequest) -> None:
    if request.suffix:
        raise BadRequestError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise BadRequestError(f"best_of must equal n ({request.n}) or be left out; got {request.best_of}",
                              param="best_of")
