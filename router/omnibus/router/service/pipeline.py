"""The request pipeline, whatever the transport: the gRPC servicer (server.py) and the
OpenAI-compatible HTTP front (omnibus.router.http) both call it, so every request is
authenticated, checked, admitted, queued, dispatched, detokenized and accounted the
same way.

A request's path: authenticate → check the adapter (its name, the tenant's list, some
engine has it) → validate and tokenize → admit (tenant limits, queue caps) → wait in
the priority queue until an engine has room (with the adapter, preferring one where it
is resident) → stream the engine's tokens back as text (incremental detokenization,
stop strings) → a last message with finish reason, usage and timing. Closing the
stream early (a client cancel or disconnect) or the caller's deadline aborts the
request on the engine (EngineClient.generate), which frees the sequence's KV blocks.

`Pipeline` is the API both transports call; each job is done in its own module:
admission into a job (admit.py), the job's stream across engines (stream.py), its
messages (shaping.py), embeddings (embeddings.py) and the books (accounting.py). The
engines are asked about through the Fleet (router/omnibus/router/dispatch/fleet.py).

Every refusal or failure is a RequestError carrying a gRPC status; the pipeline logs it
once (and counts it as a refusal when no engine worked on the request), and each
transport only translates it (gRPC: abort; HTTP: the matching status).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing

from omnibus.v1 import inference_pb2
from tokenizers import Tokenizer

from omnibus.router.admission.auth import KeyStore, Tenant
from omnibus.router.admission.validation import ModelLimits
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.dispatcher import Dispatcher
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.service.accounting import Accounts
from omnibus.router.service.admit import Admitter
from omnibus.router.service.embeddings import Embedder
from omnibus.router.service.errors import RequestError
from omnibus.router.service.job import Caller, Job
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.service.shaping import Shaper
from omnibus.router.service.stream import Streamer, merge
from omnibus.router.text.detokenizer import IncrementalDetokenizer

__all__ = ["Caller", "Pipeline"]


class Pipeline:
    """The router's requests, end to end, as transport-neutral async calls that raise
    RequestError."""

    def __init__(
        self,
        config: RouterConfig,
        limits: ModelLimits,
        tokenizer: Tokenizer,
        keys: KeyStore,
        dispatcher: Dispatcher,
        fleet: Fleet,
        metrics: RouterMetrics,
    ) -> None:
        self.tokenizer = tokenizer
        self._keys = keys
        self._fleet = fleet
        self._metrics = metrics
        self._accounts = Accounts(metrics)
        self._admitter = Admitter(config, limits, tokenizer, fleet, dispatcher.queue, metrics)
        self._shaper = Shaper(tokenizer)
        self._streamer = Streamer(config, dispatcher, fleet, self._shaper, self._accounts, metrics)
        self._embedder = Embedder(self._admitter, fleet, metrics)

    @property
    def metrics(self) -> RouterMetrics:
        """The router's metrics (what --metrics-port and the HTTP front's /metrics show)."""
        return self._metrics

    def serving(self) -> bool:
        """Whether some engine takes requests now: the router's readiness (else a new
        request is UNAVAILABLE, no_engine)."""
        return self._fleet.serving()

    @property
    def limits(self) -> ModelLimits:
        """The model's limits, at most the longest context an engine reports serving."""
        return self._admitter.limits

    # ---- rules the transports ask ------------------------------------------------

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]], request_id: str = "") -> Tenant:
        """The tenant of `authorization: Bearer <key>` in the call's metadata or headers
        (lower-case names). Raises RequestError(UNAUTHENTICATED), logged with the client's
        `request_id` (not checked yet: at most its first 128 characters)."""
        try:
            return self._keys.authenticate(metadata)
        except RequestError as err:
            raise self.refused(err, request_id[:128]) from None

    def detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A new stream's detokenizer (special tokens skipped, continuing `prompt_ids`), as
        every stream's text is made."""
        return self._shaper.detokenizer(prompt_ids)

    def model_adapter(self, model: str, header: str | None, tenant: Tenant) -> str | None:
        """The adapter an OpenAI `model` (and x-adapter-id `header`) names: "" for the
        base model, None for an unknown model (admit.py: Admitter.model_adapter)."""
        return self._admitter.model_adapter(model, header, tenant)

    def check_embedding_adapter(self, adapter: str, fix: str, param: str | None = None) -> None:
        """Embeddings come from the base model only (INVALID_ARGUMENT saying `fix`)."""
        self._admitter.check_embedding_adapter(adapter, fix, param)

    def check_priority(self, priority: int, name: str = "priority") -> None:
        """A priority within --max-abs-priority (INVALID_ARGUMENT naming `name`)."""
        self._admitter.check_priority(priority, name)

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """max_tokens when a chat request sets none: up to the context of an engine that
        takes it (the OpenAI API's default), at least 1."""
        return self._admitter.default_max_tokens(prompt_tokens)

    def list_models(self, tenant: Tenant) -> inference_pb2.ListModelsResponse:
        """The base model and its limits, and the adapters `tenant` may use that some
        engine has."""
        limits = self.limits
        model = inference_pb2.ModelInfo(
            id=limits.model_id,
            max_context_length=limits.context,
            vocab_size=limits.vocab_size,
            max_tokens_limit=limits.max_tokens,
        )
        names = sorted(n for n in self._fleet.adapters() if tenant.may_use(n))
        adapters = [inference_pb2.AdapterInfo(id=n, base_model_id=limits.model_id) for n in names]
        return inference_pb2.ListModelsResponse(base_model=model, adapters=adapters)

    # ---- calls ---------------------------------------------------------------

    async def generate(
        self, request: inference_pb2.GenerateRequest, caller: Caller
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams one completion: text deltas and token ids, then a last message with
        the finish reason, usage and timing. Nothing happens until the first message is
        asked for; a refusal (before or during the stream) raises RequestError. Closing
        the generator early cancels the engine work."""
        (job,) = await self._admitted([request], caller)
        async with aclosing(self._streamer.served(job)) as responses:
            async for response in responses:
                yield response

    async def generate_choices(
        self,
        requests: list[inference_pb2.GenerateRequest],
        caller: Caller,
        per_prompt: int = 0,
        admitted: Callable[[list[int]], None] | None = None,
    ) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse], None]:
        """`generate` for the choices of one client request (HTTP's n, and its batched
        prompts), served side by side: (index, response) as they come. `requests` are
        groups of `per_prompt` choices of one prompt each (0: all of one prompt); each
        prompt is tokenized once. The choices are admitted together, all or none, so a
        refusal charges nothing and describes the whole request. `admitted`, when given,
        gets each choice's prompt token count once they are admitted."""
        jobs = await self._admitted(requests, caller, per_prompt)
        for job in jobs:  # the choices are served on tasks of their own; this one writes
            job.writer = asyncio.current_task()
        try:
            if admitted is not None:
                admitted([len(job.request.prompt_ids) for job in jobs])
            async with aclosing(merge([self._streamer.served(job) for job in jobs])) as responses:
                async for item in responses:
                    yield item
        finally:
            for job in jobs:  # a choice closed before its stream started still holds a permit
                job.permit.release(0)

    def stall_error(self) -> RequestError | None:
        """When the current task's write was cancelled because its client stopped reading
        (--client-stall-seconds), the status the transport ends the call with; else None."""
        return self._streamer.stall_error()

    async def close(self) -> None:
        """After the drain: what admission holds open (the shared limits store) closes."""
        await self._admitter.close()

    def drain(self) -> None:
        """The router's drain is out of time: every stream ends now, those being served
        with a final ABORTED message carrying usage, those still queued UNAVAILABLE."""
        self._streamer.drain()

    async def embed(
        self, request: inference_pb2.EmbedRequest, caller: Caller
    ) -> inference_pb2.EmbedResponse:
        """Validates and tokenizes the inputs, then hands them to the least loaded engine
        that takes them (embeddings.py)."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            return await self._embedder.embed(request, request_id, caller)
        except RequestError as err:
            raise self.refused(err, request_id) from None

    def refused(self, err: RequestError, request_id: str) -> RequestError:
        """Counts and logs a refusal (also one a transport makes while parsing a request),
        once however many layers pass it on, and returns it, to raise."""
        return self._accounts.refused(err, request_id)

    async def _admitted(
        self, requests: list[inference_pb2.GenerateRequest], caller: Caller, per_prompt: int = 0
    ) -> list[Job]:
        """The requests validated and admitted together, or the refusal, counted and logged."""
        ids = [request.request_id or uuid.uuid4().hex for request in requests]
        try:
            return await self._admitter.admit(requests, ids, caller, per_prompt)
        except RequestError as err:
            raise self.refused(err, ids[0]) from None
