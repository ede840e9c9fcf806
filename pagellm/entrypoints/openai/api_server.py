"""The OpenAI-compatible HTTP server: FastAPI routes over one ``AsyncLLMEngine``.

``build_app`` wires routes, errors, auth and the engine's lifetime (uvicorn's lifespan starts
the engine thread and stops it); ``run_server`` adds uvicorn and graceful signal handling.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import pagellm
from pagellm.engine.async_engine import AsyncLLMEngine, EngineClient, LoopOptions
from pagellm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagellm.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from pagellm.entrypoints.media import MediaPolicy, allowed_hosts
from pagellm.entrypoints.openai.errors import (
    AuthenticationError,
    NotFoundError,
    OpenAIError,
    RequestTooLargeError,
    ServiceUnavailableError,
    error_response,
    install_error_handlers,
)
from pagellm.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagellm.entrypoints.openai.reasoning import reasoning_parser
from pagellm.entrypoints.openai.responses.protocol import ResponsesRequest
from pagellm.entrypoints.openai.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from pagellm.entrypoints.openai.embeddings.scoring import OpenAIServingScores
from pagellm.entrypoints.openai.embeddings.serving import OpenAIServingEmbedding
from pagellm.entrypoints.openai.responses.serving import OpenAIServingResponses
from pagellm.entrypoints.openai.responses.store import ResponseStore
from pagellm.entrypoints.openai.request_body import add_body_schemas, body_openapi, parse_body
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.lora_routes import install_lora_routes
from pagellm.entrypoints.openai.serving_models import LoRAModule, ServedModels
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.entrypoints.openai.tool_calls.parsers import tool_parser
from pagellm.entrypoints.ui.feed import FeedOptions, SnapshotFeed
from pagellm.entrypoints.ui.routes import API_PREFIX as UI_API_PREFIX
from pagellm.entrypoints.ui.routes import install_ui
from pagellm.metrics.prometheus import PrometheusMetrics
from pagellm.utils import release_free_memory

logger = logging.getLogger(__name__)

# Paths that need the API key when one is set (as vLLM: the API, not health or metrics; the web
# page's snapshot API too, not its static files, so that the page can load and ask for the key).
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", UI_API_PREFIX)


@dataclass
class ServerSettings:
    served_model_names: list[str]  # the first one names the model in responses
    api_key: str | None = None
    trust_request_chat_template: bool = False  # let clients send chat templates (programs) of their own
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST  # in one /v1/completions request
    tool_call_parser: str = "hermes"  # the format tool calls are written in (tool_calls/parsers.py)
    enable_auto_tool_choice: bool = True  # tool_choice "auto": parse calls out of free text
    reasoning_parser: str | None = None  # how answers' thinking is split off (reasoning.py); None: not
    structured_outputs_in_reasoning: bool = False  # constraints apply to the thinking too (vLLM's enable_in_reasoning)
    enable_ui: bool = True  # the web page at / and its snapshot API (pagellm.entrypoints.ui)
    ui: FeedOptions = field(default_factory=FeedOptions)  # how often the page's snapshots are taken
    lora_modules: list[LoRAModule] = field(default_factory=list)  # adapters served from the start
    # Raises ValueError naming what is wrong with an adapter folder for the model (None: LoRA is off).
    lora_check: Callable[[str], None] | None = None
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts image URLs are fetched from

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a non-empty key, or none to serve without one")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}")
        if (self.lora_modules or self.allow_runtime_lora_updating) and self.lora_check is None:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        allowed_hosts(self.allowed_media_domains)  # a ValueError naming a malformed entry
        tool_parser(self.tool_call_parser)  # a ValueError naming the choices
        parser = reasoning_parser(self.reasoning_parser)
        if parser is not None and parser.keeps_special_tokens and self.tool_call_parser != "hermes":
            raise ValueError(f"--reasoning-parser {self.reasoning_parser} hands tool calls on in hermes form: use "
                             f"--tool-call-parser hermes, not {self.tool_call_parser}")  # fmt: skip


# A body larger than this was parsed into enough objects that the C heap is trimmed once its
# request ends (``release_free_memory``): else the process keeps its peak RSS for good.
TRIM_AFTER_BODY_BYTES = 1 << 20


class BodySizeLimitMiddleware:
    """413 for a body over the limit: by its Content-Length at once, else as soon as it grows past it.

    The body is read here, in full, and handed on as one message; every route reads its whole
    JSON body anyway. Later messages (the client's disconnect) pass through untouched.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size > TRIM_AFTER_BODY_BYTES:  # what parsing it took goes back to the OS
                await asyncio.to_thread(release_free_memory)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = RequestTooLargeError(f"the request body is larger than {self.max_bytes} bytes", code="body_too_large")
        await error_response(error, scope["path"])(scope, receive, send)


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched.
    The key comes as ``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>``
    (Anthropic's)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = AuthenticationError(
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            code="invalid_api_key",
        )
        await error_response(error, scope["path"])(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._expected):
            return True
        api_key = headers.get("x-api-key")
        return api_key is not None and hmac.compare_digest(api_key.strip().encode(), self._expected)


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
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)  # outermost: no body read before auth
    names = settings.served_model_names
    served = served_models(settings)
    completion = OpenAIServingCompletion(engine, served, settings.max_prompts_per_request)
    media = MediaPolicy(allowed_hosts(settings.allowed_media_domains))
    chat = OpenAIServingChat(
        engine, served, settings.trust_request_chat_template, tool_parser(settings.tool_call_parser),
        settings.enable_auto_tool_choice, reasoning_parser(settings.reasoning_parser),
        settings.structured_outputs_in_reasoning, media,
    )  # fmt: skip
    tokenization = OpenAIServingTokenization(engine, served, media=media)
    embedding = OpenAIServingEmbedding(engine, served, settings.max_prompts_per_request)
    scores = OpenAIServingScores(embedding)
    messages = AnthropicServingMessages(chat)
    responses = OpenAIServingResponses(chat, ResponseStore())

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            raise ServiceUnavailableError(engine.status_message, code="engine_unavailable", retry_after_s=5)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": pagellm.__version__, "kernel_plan": engine.kernel_plan_info})

    def model_cards() -> list[ModelCard]:
        return served.cards(engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=model_cards()).model_dump())

    @app.get("/v1/models/{model_id:path}")  # (names such as org/model)
    async def model(model_id: str) -> JSONResponse:
        card = next((c for c in model_cards() if c.id == model_id), None)
        if card is None:
            raise NotFoundError(f"the model {model_id!r} is not served here (served: {', '.join(served.names)})",
                                param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(card.model_dump())

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # Bodies are parsed and validated in a worker thread (request_body.py), not by FastAPI.
    add_body_schemas(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                           ResponsesRequest, MessagesRequest, CountTokensRequest, EmbeddingRequest,
                           ScoreRequest, RerankRequest])  # fmt: skip

    @app.post("/v1/completions", openapi_extra=body_openapi(CompletionRequest))
    async def completions(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CompletionRequest)
        return await completion.create_completion(request, raw_request)

    @app.post("/v1/chat/completions", openapi_extra=body_openapi(ChatCompletionRequest))
    async def chat_completions(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ChatCompletionRequest)
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses", openapi_extra=body_openapi(ResponsesRequest))
    async def create_response(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ResponsesRequest)
        return await responses.create(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return await responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        return await responses.delete(response_id)

    @app.post("/v1/embeddings", openapi_extra=body_openapi(EmbeddingRequest))
    async def create_embedding(raw_request: Request) -> Response:
        request = await parse_body(raw_request, EmbeddingRequest)
        return await embedding.create_embedding(request, raw_request)

    # vLLM's scoring APIs, by the cosine similarity of embeddings (embeddings/scoring.py).
    @app.post("/v1/score", openapi_extra=body_openapi(ScoreRequest))
    @app.post("/score", openapi_extra=body_openapi(ScoreRequest), include_in_schema=False)
    async def score(raw_request: Request) -> Response:
        request = await parse_body(raw_request, ScoreRequest)
        return await scores.score(request, raw_request)

    @app.post("/v1/rerank", openapi_extra=body_openapi(RerankRequest))
    @app.post("/rerank", openapi_extra=body_openapi(RerankRequest), include_in_schema=False)
    async def rerank(raw_request: Request) -> Response:
        request = await parse_body(raw_request, RerankRequest)
        return await scores.rerank(request, raw_request)

    # Anthropic's Messages API (its own error shape: anthropic/errors.py).
    @app.post("/v1/messages", openapi_extra=body_openapi(MessagesRequest))
    async def create_message(raw_request: Request) -> Response:
        request = await parse_body(raw_request, MessagesRequest)
        return await messages.create_message(request, raw_request)

    @app.post("/v1/messages/count_tokens", openapi_extra=body_openapi(CountTokensRequest))
    async def count_message_tokens(raw_request: Request) -> Response:
        request = await parse_body(raw_request, CountTokensRequest)
        return await messages.count_tokens(request)

    if settings.allow_runtime_lora_updating:
        install_lora_routes(app, served)
    if settings.enable_ui:
        install_ui(app, SnapshotFeed(engine, metrics, names[0], settings.ui), api_key_required=bool(settings.api_key))

    @app.post("/tokenize", openapi_extra=body_openapi(TokenizeRequest))
    async def tokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, TokenizeRequest)
        response = await asyncio.to_thread(tokenization.tokenize, request)  # long texts: off the event loop
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/detokenize", openapi_extra=body_openapi(DetokenizeRequest))
    async def detokenize(raw_request: Request) -> JSONResponse:
        request = await parse_body(raw_request, DetokenizeRequest)
        response = await asyncio.to_thread(tokenization.detokenize, request)
        return JSONResponse(response.model_dump())

    return app


def served_models(settings: ServerSettings) -> ServedModels:
    """The served names: the model's, then each ``--lora-modules`` adapter (checked now: a bad
    one is a ValueError naming it, and the server does not start)."""
    served = ServedModels(settings.served_model_names, settings.lora_check)
    for module in settings.lora_modules:
        try:
            served.add(module.name, module.path, module.base_model_name)
        except OpenAIError as exc:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {exc.message}") from None
    return served


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
    llm_engine: EngineClient,
    settings: ServerSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    graceful_timeout_s: int = 10,
    max_requests: int | None = None,
    max_restarts: int = 0,
) -> int:
    """Serve until SIGINT/SIGTERM (exit status 0) or until the engine is dead for good (1).

    ``max_requests`` bounds the requests in flight (more get 503 + Retry-After); a failed
    engine is restarted up to ``max_restarts`` times, after which the server stops so that a
    supervisor can start it anew (as vLLM does).
    """
    per_replica = llm_engine.num_replicas > 1  # data parallelism: a series per replica
    metrics = PrometheusMetrics(
        settings.served_model_names[0], stats=lambda: llm_engine.stats,
        replica_stats=(lambda: llm_engine.replica_stats) if per_replica else None,
    )
    server: _Server | None = None

    def stop_serving() -> None:
        logger.error("the engine is dead and will not be restarted: stopping the server")
        if server is not None:
            server.should_exit = True  # uvicorn's main loop polls it

    loop_options = LoopOptions(max_requests=max_requests, max_restarts=max_restarts, on_dead=stop_serving)
    engine = AsyncLLMEngine(llm_engine, metrics, loop_options)
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
    return 1 if engine.error is not None else 0
