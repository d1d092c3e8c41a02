"""The OpenAI-compatible HTTP front: /v1/completions (completions.py),
/v1/chat/completions (chat.py), /v1/responses (responses.py), /v1/embeddings
(embeddings.py) and /v1/models (models.py) on aiohttp, in the router's own event loop,
and what vLLM-class clients probe beside them: /health, /version, /metrics (here),
/tokenize, /detokenize and /tokenizer_info (tokenization.py). This module is the
application: the route table, the middleware that answers every error as OpenAI's JSON,
startup and shutdown.

Each endpoint reads its body (bodies.py), turns it into omnibus.v1 requests
(v1_requests.py), shapes the replies as OpenAI's JSON (shapes.py) and calls the
router's Pipeline, the one the gRPC service calls, through the plumbing they share
(serving.py): the same authentication (the `Authorization: Bearer` header), adapter
permission, validation, admission, queues, engine routing, detokenization and stop
strings. A RequestError becomes the HTTP status of its gRPC status, in OpenAI's error
JSON (errors.py). A stream's headers go out only once every choice has its first tokens,
so a refusal in the queue (429, 503, 504) is still a status; later errors arrive as an
SSE `data: {"error": ...}` event (sse.py). The server cancels a handler whose client
disconnects, which closes the pipeline's streams and so the engine calls.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import choose_encoder

from omnibus.common.metrics import exposition
from omnibus.router.admission.validation import check_request_id
from omnibus.router.config import RouterConfig
from omnibus.router.http.chat import ChatServing
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.http.completions import CompletionServing
from omnibus.router.http.embeddings import EmbeddingServing
from omnibus.router.http.errors import REQUEST_ID, REQUEST_ID_HEADER, error_body, error_response
from omnibus.router.http.models import ModelServing
from omnibus.router.http.responses import ResponsesServing
from omnibus.router.http.serving import metadata
from omnibus.router.http.sse import STREAMING
from omnibus.router.http.tokenization import TokenizationServing
from omnibus.router.service.errors import TOO_LARGE, RequestError
from omnibus.router.service.pipeline import Pipeline
from omnibus.router.text.token_bytes import TokenBytes

log = structlog.get_logger("router.http")

_HTTP_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
_MAX_BODY = web.AppKey("omnibus.max_body", int)  # the request body limit, bytes
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method, body too large), and any error
    a handler did not expect, as OpenAI JSON."""
    try:
        response = await handler(request)
    except ConnectionResetError:
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = _HTTP_ERROR_TYPES.get(exc.status, "invalid_request_error")
        message = f"{exc.reason}: {request.method} {request.path}"
        if exc.status == 413:
            message = f"the request body is over the {request.app[_MAX_BODY]} byte limit"
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        code = TOO_LARGE if exc.status == 413 else None
        response = web.json_response(error_body(message, kind, code), status=exc.status, headers=headers)
    except Exception as exc:  # a bug: logged, and the client still gets JSON
        log.exception("http_handler_failed", method=request.method, path=request.path)
        if request.get(STREAMING):  # the headers are out: aiohttp ends the connection
            raise
        response = web.json_response(
            error_body(f"internal error: {type(exc).__name__}", "server_error", "internal"), status=500)
    request_id = request.get(REQUEST_ID)
    if request_id is not None and not response.prepared and _is_request_id(request_id):
        response.headers.setdefault(REQUEST_ID_HEADER, request_id)  # on errors too, as OpenAI
    return response


def _is_request_id(value: str) -> bool:
    try:
        check_request_id(value)
    except RequestError:
        return False  # refused, and not echoed
    return True


class OpenAIFront:
    """The HTTP application over one Pipeline: each endpoint's handlers are its module's
    Serving (serving.py); /health, /version and /metrics are here."""

    def __init__(self, pipeline: Pipeline, config: RouterConfig, chat: ChatTemplate | None) -> None:
        self._pipeline = pipeline
        self._config = config
        self._runner: web.AppRunner | None = None
        self._draining = False  # stop() was called: /health says 503
        metrics = pipeline.metrics
        self._metrics = exposition(metrics.registry, metrics.model_name)  # as on --metrics-port
        shared = (pipeline, config, chat, TokenBytes(pipeline.tokenizer))
        self._completions = CompletionServing(*shared)
        self._chat = ChatServing(*shared)
        self._responses = ResponsesServing(*shared)
        self._embeddings = EmbeddingServing(*shared)
        self._models = ModelServing(*shared)
        self._tokenization = TokenizationServing(*shared)

    def app(self) -> web.Application:
        max_body = 2 * self._config.max_request_bytes + 4096  # ours is the clearer refusal
        app = web.Application(middlewares=[_json_errors], client_max_size=max_body)
        app[_MAX_BODY] = max_body
        app.add_routes([
            web.post("/v1/completions", self._completions.completions),
            web.post("/v1/chat/completions", self._chat.chat_completions),
            web.post("/v1/responses", self._responses.responses),
            web.post("/v1/embeddings", self._embeddings.embeddings),
            web.get("/v1/models", self._models.models),
            web.get("/v1/models/{model:.+}", self._models.model),
            web.get("/health", self.health),
            web.get("/version", self.version),
            web.get("/metrics", self.metrics),
            web.post("/tokenize", self._tokenization.tokenize),
            web.post("/detokenize", self._tokenization.detokenize),
            web.get("/tokenizer_info", self._tokenization.tokenizer_info),
        ])  # fmt: skip
        return app

    async def start(self) -> None:
        # handler_cancellation: a client that disconnects cancels its handler.
        self._runner = web.AppRunner(
            self.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self._config.drain_seconds,
        )
        logging.getLogger("aiohttp.server").addFilter(_bad_http_request)
        await self._runner.setup()
        await web.TCPSite(self._runner, self._config.host, self._config.http_port,
                          ssl_context=self._config.http_tls()).start()

    async def stop(self) -> None:
        """Stops listening, then lets running requests finish for --drain-seconds."""
        self._draining = True
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- the router's own endpoints ----------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 (no body, as vLLM) while the router can serve: some engine takes requests,
        as the gRPC health service reports SERVING; else 503. Open to anyone, as the gRPC
        health service is: probes and load balancers carry no key."""
        if self._draining:
            why = "the router is draining (shutting down)"
        elif not self._pipeline.serving():
            why = "no engine worker is taking requests"
        else:
            return web.Response()
        return web.json_response(error_body(why, "service_unavailable_error", "not_serving"),
                                 status=503)

    async def version(self, request: web.Request) -> web.Response:
        """The omnibus release, as vLLM's GET /version; open to anyone, as /health."""
        try:
            release = importlib.metadata.version("omnibus")
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            release = "unknown"
        return web.json_response({"version": release})

    async def metrics(self, request: web.Request) -> web.Response:
        """The router's Prometheus metrics, what --metrics-port serves, for a caller with a
        key (the series name tenants)."""
        try:
            self._pipeline.authenticate(metadata(request))
        except RequestError as err:
            return error_response(err)
        # The format the scraper asks for (Prometheus text or OpenMetrics), as on --metrics-port.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self._metrics), headers={"Content-Type": content_type})


def _bad_http_request(record: logging.LogRecord) -> bool:
    """aiohttp logs a request it cannot parse (the client's error, answered 400) as an
    error with a traceback: one info line naming it instead, so malformed requests
    cannot fill the log with tracebacks."""
    exc = record.exc_info[1] if record.exc_info else None
    if not isinstance(exc, HttpProcessingError):
        return True
    if not logging.getLogger().isEnabledFor(logging.INFO):
        return False
    record.levelno, record.levelname = logging.INFO, "INFO"
    record.msg, record.args, record.exc_info, record.exc_text = (
        "bad_http_request: %s (%s)", (type(exc).__name__, exc.message[:100]), None, None)
    return True
