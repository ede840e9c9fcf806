"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLMEngine``.

``build_app`` wires routes, errors, auth and the engine's lifetime (uvicorn's lifespan starts
the engine thread and stops it); ``run_server`` adds uvicorn and graceful signal handling.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

import pagellm
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.engine_process import EngineProcess
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.errors import (
    AuthenticationError,
    ServiceUnavailableError,
    error_response,
    install_error_handlers,
)
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.metrics.prometheus import PrometheusMetrics

logger = logging.getLogger(__name__)

# Paths that need the API key when one is set (as vLLM: the API, not health or metrics).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class ServerSettings:
    served_model_names: list[str]  # the first one names the model in responses
    model_path: str  # what was loaded (the models list's ``root``)
    api_key: str | None = None


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = AuthenticationError(
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'.", code="invalid_api_key"
        )
        await error_response(error)(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected)


def build_app(engine: AsyncLLMEngine, settings: ServerSettings, metrics: PrometheusMetrics) -> FastAPI:
    """The ASGI app; the engine thread runs exactly as long as the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        logger.info("serving %s", ", ".join(settings.served_model_names))
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagellm", version=pagellm.__version__, lifespan=lifespan)
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    names = settings.served_model_names
    completion = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names)
    tokenization = OpenAIServingTokenization(engine, names)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise ServiceUnavailableError(
                f"the engine loop died: {engine.error!r}" if engine.error else "the engine is not running"
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagellm.__version__})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=settings.model_path, max_model_len=engine.max_model_len) for name in names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.tokenize(request).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse(tokenization.detokenize(request).model_dump())

    return app


class _Server(uvicorn.Server):
    """uvicorn, plus: the first SIGINT/SIGTERM also aborts every in-flight request.

    Without that, uvicorn's graceful shutdown would wait for every running generation to
    finish; aborting ends their responses (503 / an in-band error event) right away.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine) -> None:
        super().__init__(config)
        self._engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._engine.begin_shutdown()


def _ignore_replayed_signals() -> None:
    """uvicorn re-raises the signal that stopped it once shutdown is done; make that a no-op so we exit 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)


def run_server(
    llm_engine: LLMEngine | EngineProcess,
    settings: ServerSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout_s: int = 10,
) -> None:
    """Serve until SIGINT/SIGTERM, then abort in-flight requests, stop the engine and return."""
    metrics = PrometheusMetrics(settings.served_model_names[0], stats=lambda: llm_engine.stats)
    engine = AsyncLLMEngine(llm_engine, metrics)
    app = build_app(engine, settings, metrics)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_timeout_s,
        access_log=log_level == "debug",
    )
    server = _Server(config, engine)
    _ignore_replayed_signals()
    server.run()
    if not server.started:
        raise RuntimeError(f"the server could not start on {host}:{port}")
