"""The FastAPI app: routes, bearer-token auth, and every error in OpenAI's error shape."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vacpack import __version__
from vacpack.openai_api.errors import APIError, internal_error
from vacpack.openai_api.responses import now_s
from vacpack.server.handlers import ClientDisconnected, OpenAIHandlers, json_response
from vacpack.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger(__name__)

# Not a real HTTP status: nginx's "client closed request", logged for requests nobody awaits.
_CLIENT_CLOSED_REQUEST = 499


def error_response(error: APIError) -> Response:
    return json_response(error.to_body(), error.status_code, headers=error.headers)


class BearerAuth:
    """Pure ASGI (not BaseHTTPMiddleware, which would break streaming and disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _needs_key(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Pure ASGI: 413 for a request body over the limit, by its Content-Length before it is
    read, or as soon as a body without one (chunked) grows past it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self._max_body_bytes = max_body_bytes

    def _too_large(self) -> APIError:
        limit = self._max_body_bytes
        message = f"the request body is larger than this server's limit of {limit} bytes"
        return APIError(413, message, code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        num_received_bytes = 0

        async def receive_within_limit() -> Message:
            nonlocal num_received_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_received_bytes += len(message.get("body", b""))
                if num_received_bytes > self._max_body_bytes:
                    raise self._too_large()  # answered by the app's APIError handler
            return message

        await self.app(scope, receive_within_limit, send)


# Paths outside /v1 that answer model requests, and so need the key as /v1 does.
_KEYED_PATHS = frozenset(
    {"/score", "/rerank", "/pooling", "/tokenize", "/detokenize", "/invocations"}
)


def _needs_key(path: str) -> bool:
    return path.startswith("/v1") or path in _KEYED_PATHS


def build_app(handlers: OpenAIHandlers, metrics: ServerMetrics) -> FastAPI:
    engine = handlers.engine
    shutdown_timeout_s = handlers.config.shutdown_timeout_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop(timeout_s=shutdown_timeout_s)

    app = FastAPI(title="vacpack", lifespan=lifespan, docs_url=None, redoc_url=None)
    created = now_s()

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> Response:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}"}.get(
            error.status_code, str(error.detail)
        )
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return error_response(APIError(error.status_code, message, code=code))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        return error_response(APIError(400, str(error)))

    # ClientDisconnect: the client left while its body was being read. Without its own handler
    # it would reach on_unexpected, which logs it as a bug (and Starlette raises it again, for
    # uvicorn to log once more): a client could fill the error log with tracebacks.
    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(
        request: Request, error: ClientDisconnected | ClientDisconnect
    ) -> Response:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error answering %s", request.url.path)
        return error_response(internal_error(error))

    # /ping and /invocations: the routes Amazon SageMaker calls, as vLLM serves them.
    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        problem = engine.health_problem
        if problem is not None:
            return error_response(APIError(503, problem))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/v1/models")
    async def models() -> Response:
        return handlers.models(created)

    # The model's id may hold slashes (a hub name such as Qwen/Qwen2.5-0.5B).
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return handlers.model(model_id, created)

    # vLLM's paths: /score, /rerank, /classify and /pooling with and without /v1, /tokenize
    # and /detokenize without; SageMaker's /invocations.
    post_routes: dict[tuple[str, ...], Callable[[Request], Awaitable[Response]]] = {
        ("/v1/completions",): handlers.completions,
        ("/v1/chat/completions",): handlers.chat_completions,
        ("/v1/embeddings",): handlers.embeddings,
        ("/v1/score", "/score"): handlers.score,
        ("/v1/rerank", "/rerank"): handlers.rerank,
        ("/v1/classify", "/classify"): handlers.classify,
        ("/v1/pooling", "/pooling"): handlers.encode,  # LLM.encode's tasks
        ("/invocations",): handlers.invocations,
        ("/tokenize",): handlers.tokenize,
        ("/detokenize",): handlers.detokenize,
    }
    for paths, handler in post_routes.items():
        for path in paths:
            app.add_api_route(path, handler, methods=["POST"])

    if handlers.config.allow_runtime_lora_updating:  # vLLM's paths

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            return await handlers.load_lora_adapter(request)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            return await handlers.unload_lora_adapter(request)

    if handlers.config.api_key:
        app.add_middleware(BearerAuth, api_key=handlers.config.api_key)
    app.add_middleware(BodySizeLimit, max_body_bytes=handlers.config.max_request_body_bytes)
    return app
