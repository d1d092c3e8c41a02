"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions,
/v1/responses (responses.py), /v1/embeddings and /v1/models on aiohttp, in the router's
own event loop, and what vLLM-class clients probe beside them: /health, /version,
/metrics, /tokenize, /detokenize and /tokenizer_info.

Each endpoint reads its body (bodies.py), turns it into omnibus.v1 requests
(v1_requests.py), shapes the replies as OpenAI's JSON (shapes.py) and calls the
router's Pipeline, the one the gRPC service calls: the same authentication (the
`Authorization: Bearer` header), adapter permission, validation, admission, queues,
engine routing, detokenization and stop strings. A RequestError becomes the HTTP status
of its gRPC status, in OpenAI's error JSON. A stream's headers go out only once every
choice has its first tokens, so a refusal in the queue (429, 503, 504) is still a status;
later errors arrive as an SSE `data: {"error": ...}` event. The server cancels a handler
whose client disconnects, which closes the pipeline's streams and so the engine calls.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.metadata
import json
import logging
import re
import sys
import time
import uuid
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from omnibus.v1 import inference_pb2 as pb
from prometheus_client.exposition import choose_encoder

from omnibus.common.metrics import exposition
from omnibus.common.sampling import check_token_ids
from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.validation import check_request_id
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import ADAPTER_HEADER
from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http import responses as rs
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.http.chat_template import tokenizer_info as read_tokenizer_info
from omnibus.router.http.tool_parser import PARSERS
from omnibus.router.service.errors import TOO_LARGE, RequestError, invalid
from omnibus.router.service.pipeline import Caller, Pipeline
from omnibus.router.text.token_bytes import TokenBytes

log = structlog.get_logger("router.http")

PRIORITY_HEADER = "x-priority"
REQUEST_ID_HEADER = "x-request-id"
# ASCII digits only: int() would also take "1_0" and other scripts' digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# gRPC status → HTTP status and OpenAI error type.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_HTTP_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}
_STREAMING = web.RequestKey("omnibus.streaming", bool)  # set on a request once its event stream's headers are sent
_MAX_BODY = web.AppKey("omnibus.max_body", int)  # the request body limit, bytes
_REQUEST_ID = web.RequestKey("omnibus.request_id", str)  # the request's id, echoed in x-request-id
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Prepared = tuple[list[pb.GenerateRequest], "shapes.CompletionShape | shapes.ChatShape"]  # prompts, shape


def http_status(code: grpc.StatusCode) -> tuple[int, str]:
    return _HTTP_STATUS.get(code, (500, "server_error"))


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Refusals whose message points to ListModels (the pipeline's unknown_adapter, adapter_denied).
_POINTS_TO_LIST_MODELS = frozenset({"unknown_adapter", "adapter_denied"})


def error_response(err: RequestError) -> web.Response:
    status, kind = http_status(err.code)
    if err.reason == TOO_LARGE:  # as aiohttp's refusal of a body past its own limit
        status = 413
    headers = {}
    message = err.message
    if err.reason in _POINTS_TO_LIST_MODELS:  # where the listing is over HTTP
        message += " (GET /v1/models over HTTP)"
    if status == 429:  # whole seconds, at least one
        headers["Retry-After"] = str(max(1, int(-(-(err.retry_after_s or 1) // 1))))
    return web.json_response(error_body(message, kind, err.reason, err.param), status=status,
                             headers=headers)


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
        if request.get(_STREAMING):  # the headers are out: aiohttp ends the connection
            raise
        response = web.json_response(
            error_body(f"internal error: {type(exc).__name__}", "server_error", "internal"), status=500)
    request_id = request.get(_REQUEST_ID)
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
    """The HTTP endpoints over one Pipeline."""

    def __init__(self, pipeline: Pipeline, config: RouterConfig, chat: ChatTemplate | None) -> None:
        self._pipeline = pipeline
        self._config = config
        self._chat = chat
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._token_bytes = TokenBytes(pipeline.tokenizer)
        self._draining = False  # stop() was called: /health says 503
        metrics = pipeline.metrics
        self._metrics = exposition(metrics.registry, metrics.model_name)  # as on --metrics-port
        self._tokenizer_info = read_tokenizer_info(config.model)

    def app(self) -> web.Application:
        max_body = 2 * self._config.max_request_bytes + 4096  # ours is the clearer refusal
        app = web.Application(middlewares=[_json_errors], client_max_size=max_body)
        app[_MAX_BODY] = max_body
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/responses", self.responses),
            web.post("/v1/embeddings", self.embeddings),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model),
            web.get("/health", self.health),
            web.get("/version", self.version),
            web.get("/metrics", self.metrics),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
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

    # ---- endpoints -----------------------------------------------------------

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
            self._pipeline.authenticate(_metadata(request))
        except RequestError as err:
            return error_response(err)
        # The format the scraper asks for (Prometheus text or OpenMetrics), as on --metrics-port.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self._metrics), headers={"Content-Type": content_type})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: a prompt's token ids as /v1/completions gets them (with
        the special tokens the tokenizer adds, unless add_special_tokens is false), or
        chat messages' as /v1/chat/completions gets them."""
        try:
            body = await self._tokenizer_body(request, bodies.TokenizeBody)
            if body.messages is not None:
                ids = await self._chat_prompt(body, body.add_generation_prompt is not False,
                                              body.add_special_tokens is True)
            else:
                add = body.add_special_tokens is not False
                ids = (await asyncio.to_thread(self._pipeline.tokenizer.encode, body.prompt,
                                               add_special_tokens=add)).ids
        except RequestError as err:
            return error_response(err)
        spell = self._pipeline.tokenizer.id_to_token
        return web.json_response({
            "count": len(ids), "max_model_len": self._pipeline.limits.context, "tokens": ids,
            "token_strs": [spell(i) for i in ids] if body.return_token_strs else None,
        })  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: the text of token ids, special tokens included (as
        transformers' decode)."""
        try:
            body = await self._tokenizer_body(request, bodies.DetokenizeBody)
            if body.tokens:  # ids the model has, as a prompt's are checked
                try:
                    check_token_ids(body.tokens, self._pipeline.limits.vocab_size, "tokens")
                except ValueError as exc:
                    raise invalid(str(exc), "tokens") from None
        except RequestError as err:
            return error_response(err)
        text = await asyncio.to_thread(self._pipeline.tokenizer.decode, body.tokens,
                                       skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's GET /tokenizer_info: the tokenizer's settings, special tokens and chat
        template (chat_template.tokenizer_info), with the context served now."""
        try:
            self._pipeline.authenticate(_metadata(request))
        except RequestError as err:
            return error_response(err)
        info = {**self._tokenizer_info, "model_max_length": self._pipeline.limits.context}
        return web.json_response(info)

    async def _tokenizer_body(self, request: web.Request, kind: type) -> Any:
        """A /tokenize or /detokenize body from a caller with a key, its `model` (if set)
        the base model or an adapter the caller may use: they share the tokenizer."""
        tenant = self._pipeline.authenticate(_metadata(request))
        body = bodies.parse(kind, await request.read())
        if body.model is not None:
            self._adapter(body.model, request.headers.get(ADAPTER_HEADER), tenant)
        return body

    async def models(self, request: web.Request) -> web.Response:
        try:
            data = self._model_entries(request)
        except RequestError as err:
            return error_response(err)
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: one entry of the listing, or 404."""
        model_id = request.match_info["model"]
        try:
            found = [m for m in self._model_entries(request) if m["id"] == model_id]
        except RequestError as err:
            return error_response(err)
        if not found:
            return error_response(self._unknown_model(model_id))
        return web.json_response(found[0])

    def _model_entries(self, request: web.Request) -> list[dict[str, Any]]:
        """The base model and the adapters the caller may use (authenticates first)."""
        listing = self._pipeline.list_models(self._pipeline.authenticate(_metadata(request)))
        base = listing.base_model
        entry = {"object": "model", "created": self._created, "owned_by": "omnibus"}
        data = [{**entry, "id": base.id, "root": base.id, "parent": None,
                 "max_model_len": base.max_context_length}]  # fmt: skip
        # An adapter named as the base model is reachable only through the x-adapter-id
        # header (`model` with that name means the base model): it is not listed twice.
        data += [{**entry, "id": a.id, "root": a.id, "parent": base.id,
                  "max_model_len": base.max_context_length}
                 for a in listing.adapters if a.id != base.id]  # fmt: skip
        return data

    def _unknown_model(self, model: str) -> RequestError:
        return RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"model {model!r} does not exist: this server serves "
            f"{self._pipeline.limits.model_id!r} and the adapters GET /v1/models lists",
            "unknown_model",
            param="model",
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, bodies.CompletionBody, self._completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, bodies.ChatBody, self._chat_request)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: the chat request a Responses body makes (responses.py),
        served as a chat request is, answered in the Responses API's shapes."""
        request_id = _request_id(request)
        try:
            caller, body = await self._start(request, rs.ResponsesBody, request_id)
            chat = body.chat_body()
            prompts, _ = await self._chat_request(chat)
            priority = self._priority(request, chat.priority)
            requests = v1_requests.fan_out(chat, prompts, 1, request_id, priority)
        except RequestError as err:
            return error_response(self._pipeline.refused(rs.as_sent(err), request_id))
        reply = rs.Reply(body, request_id)
        async with aclosing(self._pipeline.generate_choices(requests, caller, 1)) as merged:
            try:  # a stream's headers wait for its first tokens, as chat's: 429 is a status
                first = await (_first_of_each(merged, 1) if body.stream else _all(merged))
            except RequestError as err:
                return error_response(rs.as_sent(err))
            if not body.stream:
                return web.json_response(rs.finished(reply, first),
                                         headers={REQUEST_ID_HEADER: request_id})
            events = rs.events(reply, first, merged)
            return await _send_sse(request, events, request_id, rs.sse, done=b"")

    async def embeddings(self, request: web.Request) -> web.Response:
        request_id = _request_id(request)
        try:
            caller, body = await self._start(request, bodies.EmbeddingBody, request_id)
            embed = v1_requests.embed_request(body, request_id, self._priority(request, body.priority))
        except RequestError as err:
            return error_response(self._pipeline.refused(err, request_id))
        try:
            reply = await self._pipeline.embed(embed, caller)
        except RequestError as err:
            return error_response(err)
        data = [
            {"object": "embedding", "index": i,
             "embedding": _encode(list(e.values), body.encoding_format)}
            for i, e in enumerate(reply.embeddings)
        ]  # fmt: skip
        return web.json_response({
            "object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": reply.total_tokens, "total_tokens": reply.total_tokens},
        })  # fmt: skip

    # ---- request → pipeline --------------------------------------------------

    async def _start(self, request: web.Request, kind: type, request_id: str) -> tuple[Caller, Any]:
        """Authenticates (first, as on gRPC), then checks the request id, parses the body
        and resolves `model`."""
        tenant = self._pipeline.authenticate(_metadata(request), request_id)
        check_request_id(request_id, REQUEST_ID_HEADER)  # before any protobuf field holds it
        body = bodies.parse(kind, await request.read())
        header = request.headers.get(ADAPTER_HEADER)
        if kind is bodies.EmbeddingBody and body.model != self._pipeline.limits.model_id:
            # Embeddings come from the base model: `model` names it or nothing here.
            if body.model in {a.id for a in self._pipeline.list_models(tenant).adapters}:
                self._pipeline.check_embedding_adapter(body.model, "set model to the base model", "model")
            raise self._unknown_model(body.model)
        return Caller(tenant, self._adapter(body.model, header, tenant)), body

    def _adapter(self, model: str, header: str | None, tenant: Tenant) -> str:
        """`model` names the base model or an adapter (the vLLM / LoRAX convention); the
        x-adapter-id header works as on gRPC. Either goes through the tenant's list; a
        `model` the tenant may use that is neither the base model nor an adapter some
        engine has is an unknown model (404, param model), as in the OpenAI API. The
        rules are the pipeline's (Pipeline.model_adapter)."""
        adapter = self._pipeline.model_adapter(model, header, tenant)
        if adapter is None:
            raise self._unknown_model(model)
        return adapter

    def _priority(self, request: web.Request, body_priority: int | None) -> int:
        header = request.headers.get(PRIORITY_HEADER)
        if header is None:
            return body_priority or 0
        if not _INTEGER.fullmatch(header):
            raise invalid(f"{PRIORITY_HEADER} must be an integer, got {header!r}")
        priority = int(header)
        self._pipeline.check_priority(priority, PRIORITY_HEADER)  # (within the int32 field)
        if body_priority is not None and body_priority != priority:
            raise invalid(
                f"{PRIORITY_HEADER} {priority} and the body's priority {body_priority} differ; "
                "set one of them"
            )
        return priority

    async def _generation(
        self, request: web.Request, kind: type, prepare: Callable[[Any], Awaitable[Prepared]]
    ) -> web.StreamResponse:
        """A completion or chat request: parse, build one GenerateRequest per choice, serve."""
        request_id = _request_id(request)
        try:
            caller, body = await self._start(request, kind, request_id)
            prompts, shape = await prepare(body)
            priority = self._priority(request, body.priority)
            requests = v1_requests.fan_out(body, prompts, self._config.max_n, request_id, priority)
        except RequestError as err:
            return error_response(self._pipeline.refused(err, request_id))
        return await self._generate(request, shape, body, requests, caller, request_id)

    async def _completion_request(self, body: bodies.CompletionBody) -> Prepared:
        # The cap on the inputs of one embeddings request caps a batch's prompts too.
        prompts = v1_requests.completion_prompts(body.prompt, self._config.max_embed_inputs)
        logprobs = None if body.logprobs is None else bodies.check_logprobs(body.logprobs, "logprobs")
        sampling = v1_requests.sampling(body, 1 if body.prompt_only else body.max_tokens, logprobs)
        if body.echo and logprobs is not None:  # the prompt's tokens scored too (vLLM's prompt_logprobs)
            sampling.prompt_logprobs = sampling.logprobs
        detokenizers, echoes = [], []
        tokenizer = self._pipeline.tokenizer
        for prompt in prompts:
            prompt.sampling.CopyFrom(sampling)
            is_text = prompt.WhichOneof("prompt") == "text"
            ids = [] if is_text else list(prompt.token_ids.ids)
            if logprobs is not None:  # text offsets: detokenized as the text is, after the prompt
                if is_text:
                    ids = (await asyncio.to_thread(tokenizer.encode, prompt.text)).ids
                detokenizers.append(functools.partial(self._pipeline.detokenizer, ids))
            if body.echo:
                text = prompt.text if is_text else await asyncio.to_thread(self._decoded, ids)
                echoes.append(shapes.Echo(text, ids if logprobs is not None else []))
        shape = shapes.CompletionShape(logprobs, body.return_token_ids, self._token_bytes,
                                       detokenizers or self._pipeline.detokenizer,
                                       echoes if body.echo else None, self._pipeline.detokenizer)
        return prompts, shape

    def _decoded(self, ids: list[int]) -> str:
        """A token-id prompt's text, as a completion's text is made (special tokens skipped)."""
        detokenizer = self._pipeline.detokenizer()
        return detokenizer.push(ids) + detokenizer.flush()

    async def _chat_request(self, body: bodies.ChatBody) -> Prepared:
        ids = await self._chat_prompt(body)
        # The newer name; 0 is refused, not unset. The Validator checks it as max_tokens, and
        # its refusals are named as sent (_as_sent).
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None:  # as the OpenAI API: up to the context (of an engine that takes it)
            max_tokens = self._pipeline.default_max_tokens(len(ids))
        logprobs = body.logprob_count
        prompt = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
        prompt.sampling.CopyFrom(v1_requests.sampling(body, max_tokens, logprobs))
        tools = body.tool_spec()
        if tools is not None and tools.choice != "none":  # calls come back as tool_calls
            parser = PARSERS[self._config.tool_call_parser]
            return [prompt], shapes.ToolChatShape(logprobs, body.return_token_ids,
                                                  self._token_bytes, tools, parser)
        return [prompt], shapes.ChatShape(logprobs, body.return_token_ids, self._token_bytes)

    async def _chat_prompt(
        self, body: bodies.ChatBody | bodies.TokenizeBody, generation_prompt: bool = True,
        special_tokens: bool = False,
    ) -> list[int]:
        if self._chat is None:
            raise invalid(
                f"model {self._pipeline.limits.model_id!r} has no chat template (no "
                "chat_template in its tokenizer_config.json, no chat_template.jinja): use "
                "/v1/completions with a prompt instead"
            )
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        tools = body.tool_spec()
        tokenizer = self._pipeline.tokenizer

        def render() -> list[int]:  # off the event loop, as the Validator tokenizes
            text = self._chat.render(messages, generation_prompt, tools and tools.tools)
            return tokenizer.encode(text, add_special_tokens=special_tokens).ids

        return await asyncio.to_thread(render)

    # ---- pipeline → response -------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        shape: shapes.CompletionShape | shapes.ChatShape,
        body: Any,
        requests: list[pb.GenerateRequest],
        caller: Caller,
        request_id: str,
    ) -> web.StreamResponse:
        choices = [shapes.Choice(i, i // body.n) for i in range(len(requests))]
        head = {"id": shape.id_prefix + request_id, "created": int(time.time()), "model": body.model}
        prompt_tokens: list[int] = []  # each choice's, once admitted
        merged = self._pipeline.generate_choices(requests, caller, body.n, prompt_tokens.extend)
        if getattr(body, "prompt_only", False):
            merged = _prompt_only(merged)
        async with aclosing(merged):
            if not body.stream:
                try:
                    async for index, response in merged:
                        choices[index].add(response)
                except RequestError as err:
                    return error_response(_as_sent(err, body, len(requests) // body.n))
                return web.json_response({
                    **head, "object": shape.object, "choices": [shape.choice(c) for c in choices],
                    "usage": shapes.total_usage(choices),
                }, headers={REQUEST_ID_HEADER: request_id})  # fmt: skip
            try:
                first = await _first_of_each(merged, len(requests))
            except RequestError as err:
                return error_response(_as_sent(err, body, len(requests) // body.n))
            options = body.stream_options or bodies.StreamOptions()
            continuous = prompt_tokens if options.continuous_usage_stats else None
            events = _sse_events(shape, head, choices, first, merged, options.include_usage,
                                 continuous)
            return await _send_sse(request, events, request_id)


def _as_sent(err: RequestError, body: Any, prompts: int) -> RequestError:
    """A refusal that blames max_tokens (its range, the context, the engines' KV pools),
    named as the request sent it: a chat request's `max_completion_tokens` (the router's
    checks call the field max_tokens); one that blames structured_output (the schema), as
    the field that set it (`response_format`, `structured_outputs`, `guided_json`..., or
    the named tool's `tools.i.function.parameters`, `tools` for tool_choice required). One
    that blames the number of choices (`n` to the tenant limits), in a batch of `prompts`
    prompts, says that every prompt counts."""
    if err.param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        err.param = "max_completion_tokens"
        err.message = re.sub(r"\bmax_tokens\b", "max_completion_tokens", err.message)
    if err.param == "structured_output":  # the schema, as the Validator or an engine refused it
        fmt = v1_requests.structured_output(body)
        if fmt is not None:
            err.param = fmt[1]
            err.message = re.sub(r"^structured_output\b", fmt[1], err.message)
    if prompts > 1 and (err.param == "n" or "lower n" in err.message):
        err.message += (f" (the {prompts} prompts of n={body.n} choices each run "
                        f"{prompts * body.n} choices: send fewer prompts per request)")
        if err.param == "n" and body.n == 1:
            err.param = "prompt"
    return err


async def _prompt_only(
    merged: AsyncGenerator[tuple[int, pb.GenerateResponse], None],
) -> AsyncGenerator[tuple[int, pb.GenerateResponse], None]:
    """echo with max_tokens 0: the one token the engine was asked for (the prompt's
    logprobs come with it) is left out of the text, the logprobs and the usage."""
    async with aclosing(merged):
        async for index, response in merged:
            del response.token_ids[:], response.logprobs[:]
            response.text = ""
            if response.HasField("usage"):
                response.usage.completion_tokens = 0
            yield index, response


async def _first_of_each(
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]], n: int
) -> list[tuple[int, pb.GenerateResponse]]:
    """Reads until every choice has sent a message (each ends with a finish message, so
    this never runs out first)."""
    items, seen = [], set()
    while len(seen) < n:
        index, response = await anext(merged)
        items.append((index, response))
        seen.add(index)
    return items


async def _all(
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]],
) -> list[tuple[int, pb.GenerateResponse]]:
    return [item async for item in merged]


async def _sse_events(
    shape: shapes.CompletionShape | shapes.ChatShape,
    head: dict[str, Any],
    choices: list[shapes.Choice],
    first: list[tuple[int, pb.GenerateResponse]],
    merged: AsyncIterator[tuple[int, pb.GenerateResponse]],
    include_usage: bool,
    continuous: list[int] | None,
) -> AsyncGenerator[dict[str, Any], None]:
    """The stream's chunks, as the OpenAI API sends them: one per engine step and choice,
    the last with finish_reason; with include_usage, `usage: null` on each and a last
    chunk with no choices and the usage. With `continuous` (each choice's prompt tokens:
    vLLM's continuous_usage_stats) each chunk carries the usage so far instead of null."""
    started: set[int] = set()

    async def rest() -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        for item in first:
            yield item
        async for item in merged:
            yield item

    chunk = {**head, "object": shape.chunk_object}
    extra: dict[str, Any] = {"usage": None} if include_usage else {}
    prompt_tokens = 0 if continuous is None else shapes.prompt_total(choices, continuous)
    sent = 0  # tokens of every choice so far
    async for index, response in rest():
        choice = choices[index]
        choice.add(response)
        parts = shape.chunk_choices(choice, response, index not in started)
        started.add(index)
        if continuous is not None:
            sent += len(response.token_ids)
            extra = {"usage": shapes.usage_so_far(prompt_tokens, sent)}
        for part in parts:
            yield {**chunk, "choices": [part], **extra}
    if include_usage:
        yield {**chunk, "choices": [], "usage": shapes.total_usage(choices)}


async def _send_sse(
    request: web.Request, events: AsyncGenerator[dict[str, Any], None], request_id: str,
    encode: Callable[[dict[str, Any]], bytes] | None = None, done: bytes = b"data: [DONE]\n\n",
) -> web.StreamResponse:
    """`events` framed by `encode` (default: `data:` lines), then `done` (the Responses API
    sends no [DONE])."""
    encode = encode or _sse
    response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: request_id})
    await response.prepare(request)
    request[_STREAMING] = True
    try:
        async with aclosing(events):
            try:
                async for event in events:
                    await response.write(encode(event))
            except RequestError as err:  # after the headers: an error event ends the stream
                status, kind = http_status(err.code)
                await response.write(_sse(error_body(err.message, kind, err.reason, err.param)))
        if done:
            await response.write(done)
        await response.write_eof()
    except ConnectionResetError:  # the client left; closing `events` cancelled the work
        log.info("http_client_gone", request_id=request_id)
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _metadata(request: web.Request) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in request.headers.items()]


def _request_id(request: web.Request) -> str:
    """The client's x-request-id, or a new one; every response echoes it (_json_errors)."""
    request_id = request[_REQUEST_ID] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    return request_id


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


def _encode(values: list[float], encoding: str) -> list[float] | str:
    """OpenAI's base64 encoding: little-endian float32."""
    if encoding == "float":
        return values
    packed = array("f", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()
