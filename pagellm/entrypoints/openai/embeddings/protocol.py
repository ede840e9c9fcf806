"""The ``/v1/embeddings`` request and response, as OpenAI defines them, with vLLM's extensions."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol import OpenAIBaseModel, RequestBody, TokenIds, UsageInfo


class EmbeddingRequest(RequestBody):
    """One text, several texts, token ids or several token-id lists: one vector each."""

    model: str | None = None
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # matryoshka models: the first N values (then normalized)
    user: str | None = None
    # vLLM extensions.
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep each input's last N tokens
    normalize: bool | None = None  # None: the model's choice
    add_special_tokens: bool = True
    priority: int = 0


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 values


class ListResponse(OpenAIBaseModel):
    """What an embeddings or scores answer holds besides its ``data``."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(ListResponse):
    data: list[EmbeddingData]


class ScoreRequest(RequestBody):
    """vLLM's ``/score``: ``text_1`` against each of ``text_2`` (one to many), or pair by pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ListResponse):
    data: list[ScoreData]


class RerankRequest(RequestBody):
    """The Jina / Cohere rerank API (vLLM's ``/rerank``): documents ordered by relevance to a query."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
