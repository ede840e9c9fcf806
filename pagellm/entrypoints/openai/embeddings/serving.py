"""POST /v1/embeddings: each input becomes one embedding request, computed through the same
scheduler as generation and pooled by the worker (``docs/embeddings.md``)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.entrypoints.openai.embeddings.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from pagellm.entrypoints.openai.errors import BadRequestError, bad_request_from
from pagellm.entrypoints.openai.protocol import UsageInfo
from pagellm.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    OpenAIServing,
    collect_answer,
    merge_async_iterators,
    new_request_id,
    prompt_entries,
)
from pagellm.lora_request import LoRARequest
from pagellm.pooling_params import PoolingParams


@dataclass(frozen=True)
class EmbedOptions:
    """How a request's inputs are tokenized and pooled (the fields every pooling API shares)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep each input's last N tokens
    add_special_tokens: bool = True
    priority: int = 0
    lora: LoRARequest | None = None  # the adapter whose hidden states are pooled (None: the base model's)


@dataclass
class Embedded:
    """A request's vectors, one per input in order, and the tokens they took."""

    vectors: list[list[float]]
    num_tokens: int


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_alive()
        model, lora = self.resolve(request.model)
        options = EmbedOptions(request.dimensions, request.normalize, request.truncate_prompt_tokens,
                               request.add_special_tokens, request.priority, lora)  # fmt: skip
        request_id = new_request_id("embd")
        embedded = await self.embed(request_id, request.input, "input", options, raw_request)
        if embedded is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        data = [EmbeddingData(index=i, embedding=_encoded(v, request.encoding_format)) for i, v in enumerate(embedded.vectors)]
        usage = UsageInfo(prompt_tokens=embedded.num_tokens, total_tokens=embedded.num_tokens)
        return JSONResponse(EmbeddingResponse(id=request_id, model=model, data=data, usage=usage).model_dump())

    async def embed(
        self, request_id: str, inputs: str | list[str] | list[int] | list[list[int]], param: str, options: EmbedOptions,
        raw_request: Request,
    ) -> Embedded | None:
        """One vector per input (``param``: the field they came in, for errors); None when the
        client left first. Tokenizing many inputs takes a while: off the event loop."""
        params, prompts = await asyncio.to_thread(self._prepare, inputs, param, options)
        streams = self.generators(prompts, params, request_id, deltas=False, priority=options.priority,
                                  lora=options.lora)  # fmt: skip
        items = await collect_answer(merge_async_iterators(streams), raw_request)
        if items is None:
            return None
        vectors = {index: output.embedding for index, output in items if output.finished}
        return Embedded([_vector(vectors.get(i)) for i in range(len(prompts))],
                        sum(len(p.prompt_token_ids) for p in prompts))  # fmt: skip

    def _prepare(
        self, inputs: str | list[str] | list[int] | list[list[int]], param: str, options: EmbedOptions
    ) -> tuple[PoolingParams, list[ProcessedPrompt]]:
        """The pooling options checked against this model, then every input tokenized and checked."""
        try:
            params = PoolingParams(dimensions=options.dimensions, normalize=options.normalize)
            self.engine.input_processor.check_params(params)
        except ValueError as exc:
            raise bad_request_from(exc, "dimensions") from exc
        entries = prompt_entries(inputs, self.max_prompts_per_request, param)
        return params, [self._process_entry(entry, param, options) for entry in entries]

    def _process_entry(self, entry: str | list[int], param: str, options: EmbedOptions) -> ProcessedPrompt:
        prompt: dict[str, Any]
        if isinstance(entry, str):
            try:
                self.engine.input_processor.check_prompt_text(entry, param)
            except ValueError as exc:
                raise BadRequestError(str(exc), param=param) from exc
            ids = list(self.engine.tokenizer(entry, add_special_tokens=options.add_special_tokens).input_ids)
            prompt = {"prompt_token_ids": ids, "prompt": entry}
        else:
            prompt = {"prompt_token_ids": entry}
        if options.truncate_prompt_tokens is not None:
            prompt["prompt_token_ids"] = prompt["prompt_token_ids"][-options.truncate_prompt_tokens :]
        limit, length = self.engine.max_model_len, len(prompt["prompt_token_ids"])
        if length > limit:
            raise BadRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested {length} tokens "
                "in the input for embedding generation. Please reduce the length of the input.", param=param,
            )  # fmt: skip
        return self.process_prompt(prompt, param, generates=False)


def _vector(vector: list[float] | None) -> list[float]:
    if vector is None:  # (a request the engine failed raises before this)
        raise RuntimeError("an embedding request finished without a vector")
    return vector


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as OpenAI's base64 of little-endian float32 values."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
