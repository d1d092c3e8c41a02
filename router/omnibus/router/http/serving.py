"""What every endpoint of the HTTP front shares (the base class `Serving`, as vLLM's
OpenAIServing): authentication and the tenant (the `Authorization: Bearer` header, as on
gRPC), the request id, `model` resolved to an adapter, the priority, the chat template
rendered to token ids, and a completion or chat request served through the Pipeline's
generate_choices (choices merged, answered whole or streamed: sse.py). Each endpoint
module (completions.py, chat.py, responses.py, embeddings.py, models.py,
tokenization.py) subclasses it; app.py routes to them.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from aiohttp import web
from omnibus.v1 import inference_pb2 as pb

from omnibus.router.admission.auth import Tenant
from omnibus.router.admission.validation import check_request_id
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import ADAPTER_HEADER
from omnibus.router.http import bodies, shapes, v1_requests
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.http.errors import REQUEST_ID, REQUEST_ID_HEADER, error_response
from omnibus.router.http.sse import first_of_each, send_sse, sse_events
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.pipeline import Caller, Pipeline
from omnibus.router.text.token_bytes import TokenBytes

PRIORITY_HEADER = "x-priority"
# ASCII digits only: int() would also take "1_0" and other scripts' digits.
_INTEGER = re.compile(r"[+-]?[0-9]+")
Prepared = tuple[list[pb.GenerateRequest], "shapes.CompletionShape | shapes.ChatShape"]  # prompts, shape


class Serving:
    """The request plumbing of the endpoints over one Pipeline."""

    def __init__(
        self, pipeline: Pipeline, config: RouterConfig, chat: ChatTemplate | None,
        token_bytes: TokenBytes,
    ) -> None:
        self._pipeline = pipeline
        self._config = config
        self._chat = chat
        self._token_bytes = token_bytes  # one for every endpoint: it caches

    # ---- request → pipeline --------------------------------------------------

    async def _start(self, request: web.Request, kind: type, request_id: str) -> tuple[Caller, Any]:
        """Authenticates (first, as on gRPC), then checks the request id, parses the body
        and resolves `model`."""
        tenant = self._pipeline.authenticate(metadata(request), request_id)
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

    def _unknown_model(self, model: str) -> RequestError:
        return RequestError(
            grpc.StatusCode.NOT_FOUND,
            f"model {model!r} does not exist: this server serves "
            f"{self._pipeline.limits.model_id!r} and the adapters GET /v1/models lists",
            "unknown_model",
            param="model",
        )

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

    async def _generation(
        self, request: web.Request, kind: type, prepare: Callable[[Any], Awaitable[Prepared]]
    ) -> web.StreamResponse:
        """A completion or chat request: parse, build one GenerateRequest per choice, serve."""
        request_id = request_id_of(request)
        try:
            caller, body = await self._start(request, kind, request_id)
            prompts, shape = await prepare(body)
            priority = self._priority(request, body.priority)
            requests = v1_requests.fan_out(body, prompts, self._config.max_n, request_id, priority)
        except RequestError as err:
            return error_response(self._pipeline.refused(err, request_id))
        return await self._generate(request, shape, body, requests, caller, request_id)

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
                first = await first_of_each(merged, len(requests))
            except RequestError as err:
                return error_response(_as_sent(err, body, len(requests) // body.n))
            options = body.stream_options or bodies.StreamOptions()
            continuous = prompt_tokens if options.continuous_usage_stats else None
            events = sse_events(shape, head, choices, first, merged, options.include_usage,
                                continuous)
            return await send_sse(request, events, request_id)


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


def metadata(request: web.Request) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in request.headers.items()]


def request_id_of(request: web.Request) -> str:
    """The client's x-request-id, or a new one; every response echoes it (app.py's
    _json_errors)."""
    request_id = request[REQUEST_ID] = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
    return request_id
