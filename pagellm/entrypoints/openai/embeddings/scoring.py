"""POST /score and /rerank (vLLM's, also under /v1): relevance as the cosine similarity of two
texts' embeddings, as vLLM scores with an embedding model. Cross-encoder rerankers (a
classification head over the pair) are not served: their checkpoints do not load here."""

from __future__ import annotations

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.entrypoints.openai.embeddings.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagellm.entrypoints.openai.embeddings.serving import EmbedOptions, OpenAIServingEmbedding
from pagellm.entrypoints.openai.errors import BadRequestError
from pagellm.entrypoints.openai.protocol import UsageInfo
from pagellm.entrypoints.openai.serving_engine import CLIENT_CLOSED_REQUEST, new_request_id


class OpenAIServingScores:
    """Scores and reranking over the embedding path (one engine request per distinct text)."""

    def __init__(self, embedding: OpenAIServingEmbedding) -> None:
        self.embedding = embedding

    async def score(self, request: ScoreRequest, raw_request: Request) -> Response:
        self.embedding.check_alive()
        model, lora = self.embedding.resolve(request.model)
        firsts = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        seconds = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if not firsts or not seconds:
            raise BadRequestError("text_1 and text_2 must not be empty", param="text_1" if not firsts else "text_2")
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise BadRequestError(f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give text_1 one text, "
                                  "or as many as text_2", param="text_1")  # fmt: skip
        request_id = new_request_id("score")
        options = EmbedOptions(truncate_prompt_tokens=request.truncate_prompt_tokens, priority=request.priority,
                               lora=lora)  # fmt: skip
        scores = await self._similarities(request_id, firsts, seconds, options, raw_request)
        if scores is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        values, tokens = scores
        data = [ScoreData(index=i, score=s) for i, s in enumerate(values)]
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        return JSONResponse(ScoreResponse(id=request_id, model=model, data=data, usage=usage).model_dump())

    async def rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        self.embedding.check_alive()
        model, lora = self.embedding.resolve(request.model)
        if not request.documents:
            raise BadRequestError("documents must not be empty", param="documents")
        request_id = new_request_id("rerank")
        options = EmbedOptions(truncate_prompt_tokens=request.truncate_prompt_tokens, priority=request.priority,
                               lora=lora)  # fmt: skip
        scores = await self._similarities(request_id, [request.query], request.documents, options, raw_request)
        if scores is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        values, tokens = scores
        order = sorted(range(len(values)), key=lambda i: -values[i])[: request.top_n or None]
        results = [RerankResult(index=i, relevance_score=values[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
                   for i in order]  # fmt: skip
        response = RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=tokens), results=results)
        return JSONResponse(response.model_dump(exclude_none=True))

    async def _similarities(
        self, request_id: str, firsts: list[str], seconds: list[str], options: EmbedOptions, raw_request: Request
    ) -> tuple[list[float], int] | None:
        """The cosine similarity of each pair (one first text against every second one, or pair
        by pair), and the tokens embedded; None when the client left first."""
        texts = list(dict.fromkeys([*firsts, *seconds]))  # each distinct text embedded once
        embedded = await self.embedding.embed(request_id, texts, "text", options, raw_request)
        if embedded is None:
            return None
        vectors = dict(zip(texts, (_unit(v) for v in embedded.vectors)))
        pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds)
        return [float(vectors[a] @ vectors[b]) for a, b in pairs], embedded.num_tokens


def _unit(vector: list[float]) -> np.ndarray:
    array = np.asarray(vector, dtype=np.float64)
    norm = np.linalg.norm(array)
    return array / norm if norm > 0 else array
