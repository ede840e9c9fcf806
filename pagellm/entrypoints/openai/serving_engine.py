"""What /v1/completions and /v1/chat/completions share.

Model-name checks, request -> ``SamplingParams``, prompt and length checks, merging the
streams of several prompts, turning engine deltas into per-choice deltas, usage, SSE framing
and client-disconnect handling all live here once; the two endpoints only differ in how a
choice's text and logprobs are shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request
from pydantic import BaseModel

from pagellm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequest,
    RequestFailedError,
    RequestStream,
)
from pagellm.engine.beam_search import BeamSearchParams
from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.media import MediaPolicy
from pagellm.entrypoints.openai.errors import (
    BadRequestError,
    OpenAIError,
    ServiceUnavailableError,
    bad_request_from,
)
from pagellm.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST
from pagellm.entrypoints.openai.protocol import SamplingRequest, UsageInfo
from pagellm.entrypoints.openai.serving_models import ServedModels
from pagellm.lora_request import LoRARequest
from pagellm.entrypoints.openai.structured_outputs import constraint_error, structured_outputs_of
from pagellm.outputs import PositionLogprobs, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# Status nginx uses for "client closed the request"; nobody reads it, it only shows in logs.
CLIENT_CLOSED_REQUEST = 499


# ---- SSE framing ------------------------------------------------------------------------------


def sse_event(payload: BaseModel, exclude: set[str] | None = None) -> str:
    """One server-sent event exactly as OpenAI frames them."""
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: BaseException) -> str:
    """An error after the stream has started: the status is already 200, so it goes in-band."""
    if not isinstance(error, OpenAIError):
        error = to_openai_error(error)
    return f"data: {json.dumps(error.to_dict())}\n\n"


def to_openai_error(error: BaseException) -> OpenAIError:
    """How engine-side failures reach HTTP clients."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, ValueError):
        return bad_request_from(error)
    if isinstance(error, EngineOverloadedError):
        return ServiceUnavailableError(str(error), code="overloaded")
    if isinstance(error, EngineDeadError):
        return ServiceUnavailableError(str(error), code="engine_unavailable", retry_after_s=5)
    if isinstance(error, RequestFailedError):
        return OpenAIError(str(error))
    return OpenAIError("internal server error (the server log has the details)")


# What the engine side may raise for one request: each becomes that request's error, never a crash.
SERVING_ERRORS = (ValueError, EngineDeadError, EngineOverloadedError, RequestFailedError)


async def guard_sse(
    events: AsyncIterator[str], on_error: Callable[[OpenAIError], str] = sse_error, done: str | None = SSE_DONE
) -> AsyncIterator[str]:
    """Close every stream (with ``done``: OpenAI's ``[DONE]``); a failure mid-stream becomes an
    in-band error event, framed by ``on_error`` (each API frames its own)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # any failure must end the stream cleanly
        if not isinstance(exc, (OpenAIError, *SERVING_ERRORS)):
            logger.exception("stream failed")
        yield on_error(to_openai_error(exc))
    if done is not None:
        yield done


async def collect_answer(stream: AsyncIterator[T], request: Request) -> list[T] | None:
    """A non-streamed answer's outputs; None when the client left first (the caller answers
    ``CLIENT_CLOSED_REQUEST``); the engine's failures as OpenAI errors."""
    try:
        return await collect_until_disconnect(stream, request)
    except ClientDisconnected:
        return None
    except SERVING_ERRORS as exc:
        raise to_openai_error(exc) from exc


# ---- streams of several prompts ------------------------------------------------------------


async def merge_async_iterators(iterators: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive, tagging each with its source.

    Leaving early (or being cancelled) cancels every source, so each request is aborted.
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _close(iterators[0])
        return
    # (source, item), a source's exception, or None when a source is exhausted.
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                queue.put_nowait((i, item))
        except Exception as exc:  # re-raised by the consumer below
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)
            await _close(iterator)  # cancelled or done: an unfinished request is aborted now

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            if isinstance(entry, BaseException):
                raise entry
            yield entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(iterator: AsyncIterator[T]) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


# ---- client disconnects ---------------------------------------------------------------------


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body was already read, so nothing else arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def collect_until_disconnect(stream: AsyncIterator[T], request: Request) -> list[T]:
    """Drain ``stream``, but abort it as soon as the client disconnects (non-streaming requests)."""

    async def drain() -> list[T]:
        return [item async for item in stream]

    drain_task = asyncio.ensure_future(drain())
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({drain_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        drain_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if drain_task.done():
        return drain_task.result()
    drain_task.cancel()  # cancelling the drain closes the engine streams: their requests abort
    with contextlib.suppress(asyncio.CancelledError):
        await drain_task
    raise ClientDisconnected()


# ---- per-choice deltas, accumulation and usage -------------------------------------------------


@dataclass
class ChoiceDelta:
    """What is new for one choice in one engine step."""

    index: int  # prompt_index * n + sample index, as OpenAI numbers choices
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None  # set on the choice's last delta only
    stop_reason: int | str | None
    first: bool


@dataclass
class PerChoice(Generic[T]):
    """A streamed answer's state for each of its choices (a parser's), made on first use."""

    make: Callable[[], T]
    choices: dict[int, T] = field(default_factory=dict)

    def of(self, index: int) -> T:
        if index not in self.choices:
            self.choices[index] = self.make()
        return self.choices[index]


@dataclass
class ChoiceTracker:
    """Turns engine deltas into per-choice deltas and counts usage as they go by.

    The engine repeats a finished sample (empty, finish reason set) in its request's later
    outputs while other samples still run; each choice is reported finished only once.
    """

    n: int
    prompt_tokens: int
    completion_tokens: int = 0
    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)

    def deltas(self, prompt_index: int, output: RequestOutput) -> list[ChoiceDelta]:
        result = []
        for sample in output.outputs:
            index = prompt_index * self.n + sample.index
            if index in self.finished:
                continue
            self.completion_tokens += len(sample.token_ids)
            if sample.finish_reason is not None:
                self.finished.add(index)
            first = index not in self.started
            self.started.add(index)
            result.append(
                ChoiceDelta(
                    index=index,
                    prompt_index=prompt_index,
                    text=sample.text,
                    token_ids=list(sample.token_ids),
                    logprobs=sample.logprobs,
                    finish_reason=sample.finish_reason,
                    stop_reason=sample.stop_reason,
                    first=first,
                )
            )
        return result

    def usage(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


@dataclass
class ChoiceResult:
    """A whole choice, for non-streaming answers: its deltas concatenated."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def accumulate(
    tracker: ChoiceTracker, items: list[tuple[int, RequestOutput]], num_prompts: int
) -> tuple[list[ChoiceResult], dict[int, RequestOutput]]:
    """Whole choices in index order, plus each prompt's first output (it carries prompt logprobs)."""
    results = {
        i: ChoiceResult(index=i, prompt_index=i // tracker.n) for i in range(num_prompts * tracker.n)
    }
    first_outputs: dict[int, RequestOutput] = {}
    for prompt_index, output in items:
        first_outputs.setdefault(prompt_index, output)
        for delta in tracker.deltas(prompt_index, output):
            results[delta.index].add(delta)
    return [results[i] for i in sorted(results)], first_outputs


# A token a grammar forbids has logprob -inf, which JSON cannot carry: reported as vLLM does.
MIN_JSON_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """A logprob as a finite JSON number."""
    return max(value, MIN_JSON_LOGPROB)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---- the shared serving base -------------------------------------------------------------------


class OpenAIServing:
    """Checks and conversions every generation endpoint makes before calling the engine."""

    def __init__(
        self, engine: AsyncLLMEngine, models: ServedModels | list[str],
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST, media: MediaPolicy = MediaPolicy(),
    ) -> None:  # fmt: skip
        """``models``: the names served (a list: the base model's alone, no adapters); ``media``:
        where images may come from (inline only, unless it lists hosts)."""
        self.engine = engine
        self.media = media
        self.models = models if isinstance(models, ServedModels) else ServedModels(models)
        self.max_prompts_per_request = max_prompts_per_request  # prompts or inputs in one request

    def resolve_model(self, requested: str | None) -> str:
        """The model name to answer with (a base model's or a LoRA adapter's); 404 for a name
        this server does not serve."""
        return self.models.resolve(requested)[0]

    def resolve(self, requested: str | None) -> tuple[str, LoRARequest | None]:
        """The model name to answer with and the LoRA adapter a generation runs with."""
        return self.models.resolve(requested)

    def check_alive(self) -> None:
        if not self.engine.is_running:
            raise ServiceUnavailableError(self.engine.status_message, code="engine_unavailable", retry_after_s=5)

    def images_of(self, urls: list[str], param: str) -> list[Any]:
        """The request's images from their URLs (``data:`` URLs, or the allowed hosts'), counted
        against the per-prompt limit before any is decoded or fetched; each refusal a 400 naming it."""
        limits = self.engine.input_processor.limits
        if len(urls) > limits.max_images_per_prompt:
            raise BadRequestError(f"the request has {len(urls)} images, more than the limit of "
                                  f"{limits.max_images_per_prompt} (--limit-mm-per-prompt)", param=param)  # fmt: skip
        images = []
        deadline = time.monotonic() + self.media.timeout_s  # (all of the request's fetches)
        for index, url in enumerate(urls):
            try:
                images.append(self.media.image(url, limits.max_image_pixels, deadline))
            except ValueError as exc:
                raise BadRequestError(f"image {index}: {exc}", param=param) from exc
        return images

    def process_prompt(
        self, prompt: dict[str, Any], param: str, cache_salt: str | None = None, generates: bool = True
    ) -> ProcessedPrompt:
        """Check one tokenized prompt with the engine's own rules (read-only, safe here);
        ``generates`` False: an embedding's input (it may fill the context)."""
        if cache_salt is not None:
            prompt = {**prompt, "cache_salt": cache_salt}
        try:
            return self.engine.input_processor.process_prompt(prompt, generates)
        except ValueError as exc:
            raise BadRequestError(str(exc), param=param) from exc

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, prompt_noun: str) -> None:
        """Prompt plus requested output must fit in max_model_len (as vLLM words it)."""
        limit = self.engine.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {prompt_noun}, "
                f"{max_tokens} in the completion). Please reduce the length of the {prompt_noun} or max_tokens.",
                param="max_tokens",
            )

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
        tool_constraint: StructuredOutputsParams | None = None,
        thinking: str | None = None,
    ) -> SamplingParams | BeamSearchParams:
        """The one conversion both endpoints use; bad values become 400s naming the field
        (``thinking``: a constraint applies after a reasoning model's thinking)."""
        check_unsupported(request)
        constraint, constraint_param = structured_outputs_of(request, tool_constraint, thinking)
        params = (
            self._beam_search_params(request, max_tokens, logprobs, prompt_logprobs, best_of, constraint)
            if request.use_beam_search
            else self._sampling_params(request, max_tokens, logprobs, prompt_logprobs, best_of, constraint)
        )
        try:
            self.engine.input_processor.check_params(params)
        except ValueError as exc:
            if constraint_param is not None and str(exc).startswith("structured_outputs."):
                raise constraint_error(exc, constraint_param) from exc  # it does not compile
            raise (_beam_request_error(exc) if isinstance(params, BeamSearchParams) else bad_request_from(exc)) from exc
        return params

    def _sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None,
        constraint: StructuredOutputsParams | None,
    ) -> SamplingParams:
        kwargs: dict[str, Any] = dict(
            n=request.n,
            temperature=_default(request.temperature, 1.0),
            top_p=_default(request.top_p, 1.0),
            top_k=_default(request.top_k, 0),
            min_p=_default(request.min_p, 0.0),
            presence_penalty=_default(request.presence_penalty, 0.0),
            frequency_penalty=_default(request.frequency_penalty, 0.0),
            repetition_penalty=_default(request.repetition_penalty, 1.0),
            seed=request.seed,
            best_of=best_of,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            structured_outputs=constraint,
        )
        try:
            return SamplingParams(**kwargs)
        except ValueError as exc:
            raise bad_request_from(exc) from exc

    def _beam_search_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        best_of: int | None,
        constraint: StructuredOutputsParams | None,
    ) -> BeamSearchParams:
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs), ("best_of", best_of)):
            if value is not None:
                raise BadRequestError(f"{name} cannot be combined with use_beam_search.", param=name)
        try:
            return BeamSearchParams(
                beam_width=request.n,
                max_tokens=max_tokens if max_tokens is not None else self.engine.max_model_len,
                ignore_eos=request.ignore_eos,
                length_penalty=request.length_penalty,
                structured_outputs=constraint,
            )
        except ValueError as exc:
            raise _beam_request_error(exc) from exc

    def generators(
        self,
        prompts: list[ProcessedPrompt],
        params: SamplingParams | BeamSearchParams | PoolingParams,
        request_id: str,
        deltas: bool = True,
        priority: int = 0,
        lora: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """One engine stream per prompt (ids ``{request_id}`` or ``{request_id}-{i}``), all submitted now;
        ``lora``: the adapter they run with (``resolve``'s).

        ``deltas=False`` asks the engine for one whole output per prompt (what best_of needs).
        An overloaded or dead engine answers 503 here, before any response starts; the prompts
        of one request are admitted all together or not at all.
        """
        try:
            self.engine.input_processor.check_priority(priority)
        except ValueError as exc:
            raise bad_request_from(exc) from exc
        if len(prompts) == 1:
            ids = [request_id]
        else:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        requests = [  # params come from ``sampling_params``, which checked them
            EngineRequest(rid, p.prompt_token_ids, params, p.prompt, p.cache_salt, stream=deltas, params_checked=True,
                          priority=priority, lora_request=lora, mm_features=p.mm_features)
            for p, rid in zip(prompts, ids)
        ]
        try:
            return self.engine.submit_all(requests)
        except (ValueError, EngineDeadError, EngineOverloadedError) as exc:
            raise to_openai_error(exc) from exc


def prompt_entries(value: str | list[str] | list[int] | list[list[int]], limit: int, param: str) -> list[str | list[int]]:
    """The four prompt forms (text, texts, token ids, token-id lists) as a list of prompts, at
    most ``limit`` of them (--max-prompts-per-request), each checked non-empty."""
    if isinstance(value, str):
        entries: list[str | list[int]] = [value]
    elif value and all(isinstance(t, int) for t in value):
        entries = [value]  # type: ignore[list-item]
    else:
        entries = list(value)  # type: ignore[arg-type]
    if len(entries) > limit:
        raise BadRequestError(f"{param} holds {len(entries)} prompts, more than the server's limit of {limit} "
                              "(--max-prompts-per-request)", param=param)  # fmt: skip
    if not entries or any(len(entry) == 0 for entry in entries):
        raise BadRequestError(f"{param} must not be empty", param=param)
    return entries


def _beam_request_error(error: ValueError) -> BadRequestError:
    """Beam search's own field names, as the request spells them (the beam width is ``n``)."""
    converted = bad_request_from(error)
    if converted.param == "beam_width":
        return BadRequestError(str(error).replace("beam_width", "n (the beam width)"), param="n")
    return converted


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


def check_unsupported(request: SamplingRequest) -> None:
    """Reject options we would otherwise silently ignore."""
    if request.logit_bias:
        raise BadRequestError("logit_bias is not supported", param="logit_bias")
