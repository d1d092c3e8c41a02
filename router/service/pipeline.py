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

Nothing lost: when the engine serving a stream dies, drains, or is marked unhealthy
(stalled), the stream continues on another engine as the prompt + the tokens already
sent (output_offset: penalties and seeded draws go on as if uninterrupted), with the
rest of max_tokens; the client sees one stream. A client that stops reading for
--client-stall-seconds has its engine work aborted and its seat freed (client_stalled).
A router drain that runs out of time ends each stream with ABORTED, usage included.

Every refusal or failure is a RequestError carrying a gRPC status; the pipeline logs it
once (and counts it as a refusal when no engine worked on the request), and each
transport only translates it (gRPC: abort; HTTP: the matching status).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
from omnibus.v1 import engine_pb2, inference_pb2
from tokenizers import Tokenizer

from omnibus.router.admission.auth import KeyStore, Tenant
from omnibus.router.admission.limits import Cost, Permit
from omnibus.router.admission.store import admission_for
from omnibus.router.admission.validation import ModelLimits, Validator, ValidRequest
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import check_adapter_name
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.engines import EngineClient, available_adapters
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.text.detokenizer import IncrementalDetokenizer, byte_fallback_ids, special_ids
from omnibus.router.text.stop import StopStringMatcher

log = structlog.get_logger("router")

STOP, UNSPECIFIED = inference_pb2.STOP, inference_pb2.FINISH_REASON_UNSPECIFIED
ABORTED, LENGTH = inference_pb2.ABORTED, inference_pb2.LENGTH
# Where else a refusal that points to ListModels sends HTTP callers.
VIA_HTTP = " (GET /v1/models over HTTP)"
T = TypeVar("T")
# A cancel this close to the deadline is the deadline: the client's own timer started
# before its call reached the router (a new connection's handshake), so its cancel can
# come a moment before the router's clock reaches the deadline it was sent.
DEADLINE_CANCEL_SLACK_S = 0.1


@dataclass(frozen=True)
class Caller:
    """Who sent a request and under which terms, whatever the transport."""

    tenant: Tenant
    adapter: str = ""  # LoRA adapter name as the client gave it; "" = the base model
    deadline: float | None = None  # monotonic seconds; None: the client set none

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def deadline_passed(self, slack: float = 0.0) -> bool:
        """Whether the deadline has passed, or will within `slack` seconds."""
        return self.deadline is not None and time.monotonic() >= self.deadline - slack


@dataclass(eq=False)  # hashed by identity: _Watch keeps a set of them
class _Job:
    """One admitted request while it is being served."""

    request: ValidRequest
    caller: Caller
    permit: Permit
    arrival: float  # monotonic seconds
    dispatched: float | None = None
    first_token: float | None = None
    engine: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Continuation: every token id sent so far (the next engine gets prompt + these), and
    # how many of them were sent before the current engine took over.
    sent_ids: list[int] = field(default_factory=list)
    offset: int = 0
    refused_by: set[str] = field(default_factory=set)  # engines that would not continue it
    queued_at: float = 0.0  # when it last entered the queue (a continuation re-enters it)
    queued_before: float = 0.0  # seconds queued before that: the queue limit is on the total
    detok: IncrementalDetokenizer | None = None  # one per stream, kept across engines
    stop: StopStringMatcher | None = None
    # Where the serving task waits now, for _Watch: "queue", "engine" (for its next
    # output), "client" (its last message is being written), "" (neither).
    waiting: str = ""
    waiting_since: float = 0.0
    serving: EngineClient | None = None
    task: asyncio.Task | None = None  # the task serving it (engine moves, drains cancel it)
    writer: asyncio.Task | None = None  # the one writing to the client, when another (HTTP n)
    interrupted: str = ""  # why _Watch interrupted it: "engine", "drain", "client_stalled"
    interrupt_note: str = ""

    @property
    def adapter(self) -> str:
        return self.caller.adapter

    @property
    def writing(self) -> asyncio.Task | None:
        """The task whose write to the client a stall holds up."""
        return self.writer or self.task

    def wait(self, where: str) -> None:
        self.waiting = where
        if where == "client":  # only a write's start is timed (_Watch: client_stalled)
            self.waiting_since = time.monotonic()

    def interrupt(self, why: str, note: str = "") -> None:
        """Cancels the serving task where it waits; the pipeline turns the cancellation
        into the move (engine), the final message (drain) or the end (client_stalled)."""
        if self.interrupted or self.task is None:
            return
        self.interrupted, self.interrupt_note = why, note
        if why == "client_stalled":  # the write that is stuck
            self.writing.cancel()
        elif why != "drain" or self.waiting != "client":  # a drain lets a write finish
            self.task.cancel()

    def take_interrupt(self) -> str:
        """Why _Watch cancelled the current task ("" when it did not: a real cancel)."""
        task = asyncio.current_task()
        if not self.interrupted or task is None or task.uncancel() > 0:
            return ""
        why, self.interrupted = self.interrupted, ""
        return why


class _EngineLost(Exception):
    """The engine can no longer serve the stream: it may go on on another one."""

    def __init__(self, error: RequestError, why: str = "engine_unavailable", what: str = "") -> None:
        super().__init__(error.message)
        self.error = error  # what the client gets when no other engine goes on with it
        self.why = why  # engine_unavailable, engine_unhealthy, engine_drained, engine_refused
        self.what = what or error.message  # what happened to the engine (the log's)


class _Drained(Exception):
    """The router's drain ran out of time while the stream was being served."""


class _Watch:
    """One task that checks every live stream a few times a second: moves those whose
    engine is marked unhealthy (a SIGSTOP'd or partitioned engine never closes its
    streams; its load reports stop), and ends those whose client has not taken a
    message for `stall` seconds. Costs nothing per token."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.jobs: set[_Job] = set()
        self.stalled: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()  # writers cancelled
        self._task: asyncio.Task | None = None

    def add(self, job: _Job) -> None:
        job.task = asyncio.current_task()
        self.jobs.add(job)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stream-watch")

    async def _run(self) -> None:
        while self.jobs:
            await asyncio.sleep(min(0.25, self.stall / 4))
            now = time.monotonic()
            for job in list(self.jobs):
                engine = job.serving
                if job.waiting == "engine" and engine is not None and not engine.healthy:
                    job.interrupt("engine", f"engine {engine.address} was marked unhealthy")
                elif job.waiting == "client" and now - job.waiting_since > self.stall:
                    writer = job.writing
                    for other in self.jobs:  # the request's other choices share the write
                        if other.writing is writer:
                            other.interrupt("client_stalled")
                    self.stalled.add(writer)

    def drain(self) -> None:
        """Ends every stream now: those being served get a final ABORTED message."""
        for job in list(self.jobs):
            job.interrupt("drain")


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
        engines: list[EngineClient],
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._model_limits = limits  # from config.json and the flags
        self._served_context = 0  # the smallest context an engine reported serving (0: none yet)
        self.tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._special_ids = special_ids(tokenizer)
        self._keys = keys
        self._validator = Validator(config, limits, tokenizer)
        self._admission = admission_for(config, metrics.registry)
        self._dispatcher = dispatcher
        self._engines = engines
        self._metrics = metrics
        self._watch = _Watch(config.client_stall_seconds)

    @property
    def metrics(self) -> RouterMetrics:
        """The router's metrics (what --metrics-port and the HTTP front's /metrics show)."""
        return self._metrics

    def serving(self) -> bool:
        """Whether some engine takes requests now: the router's readiness (else a new
        request is UNAVAILABLE, no_engine)."""
        return self._taking("")

    @property
    def limits(self) -> ModelLimits:
        """The model's limits, at most the longest context an engine reports serving (an
        engine's --max-model-len, or a cap the router cannot see in config.json), so that
        what is advertised and admitted is what an engine takes (a request goes only to
        engines whose context and KV pool hold it)."""
        return self._refresh_limits()

    def _refresh_limits(self) -> ModelLimits:
        """`limits`, handed to the validator too when an engine's report changed them."""
        served = max((e.report.max_model_len for e in self._engines
                      if e.report is not None and e.report.max_model_len > 0 and not e.retiring),
                     default=0)
        if served != self._served_context:
            self._served_context = served
            self._validator.limits = self._model_limits.within(served) if served else self._model_limits
        return self._validator.limits

    # ---- calls ---------------------------------------------------------------

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
        return IncrementalDetokenizer(self.tokenizer, self._byte_ids, self._special_ids, context=prompt_ids)

    def serves_adapter(self, name: str) -> bool:
        """Whether some engine has adapter `name` under its adapter root, as it last
        reported: one taking requests, or one down or draining for now (a restart), which
        makes a request for it UNAVAILABLE (retry), not NOT_FOUND. An engine leaving
        discovery no longer counts."""
        return any(not e.retiring and e.has_adapter(name) for e in self._engines)

    def unheard_engines(self) -> int:
        """Engines that have not reported since this router started (starting or down):
        their adapters are unknown, so a request for an adapter no other engine has is
        UNAVAILABLE (retry), not NOT_FOUND, while there are any."""
        return sum(e.report is None and not e.retiring for e in self._engines)

    def _taking(self, adapter: str, tokens: int = 0, avoid: Iterable[str] = ()) -> bool:
        """Whether some engine taking requests now can serve `adapter` ("": the base
        model) and hold a request of `tokens` (prompt + max_tokens) in its KV pool, other
        than those in `avoid`: else a new request is refused and a lost stream cannot go
        on."""
        return any(e.accepting and (not adapter or e.has_adapter(adapter)) and e.fits(tokens)
                   and e.address not in avoid for e in self._engines)

    def _unfit(self, adapter: str, prompt_tokens: int, tokens: int) -> RequestError:
        """The refusal of a request (prompt + max_tokens = `tokens`) that no engine taking
        requests (with its adapter) can hold (engines' contexts and KV pools may differ):
        UNAVAILABLE while one that can is down or draining (a restart), or while some
        engine has not reported; else INVALID_ARGUMENT naming the most an engine takes."""
        limits = [e.max_request_tokens() for e in self._engines
                  if not e.retiring and (not adapter or e.has_adapter(adapter))]
        most = max((n for n in limits if n is not None), default=0)
        if tokens <= most or self.unheard_engines():
            return RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine that can hold this request (prompt + max_tokens = {tokens} tokens) is "
                "taking requests now (down, restarting, draining or not yet reported); retry later",
                "no_engine",
            )
        if prompt_tokens + 1 > most:  # max_tokens 1 does not fit either
            return invalid(
                f"the prompt has {prompt_tokens} tokens, but the most one request may span on an "
                f"engine is {most} tokens (prompt + max_tokens; its context and KV cache); shorten "
                "the prompt",
                param="prompt",
            )
        return invalid(
            f"prompt + max_tokens = {tokens} tokens, but the most one request may span on an "
            f"engine is {most} tokens (its context and KV cache); lower max_tokens to at most "
            f"{most - prompt_tokens} or shorten the prompt",
            param="max_tokens",
        )

    def most_tokens(self) -> int:
        """The most tokens (prompt + max_tokens) one request may span on an engine taking
        requests now (else on any engine that has reported; else the model's context): what
        a default "up to the context" max_tokens fills."""
        for engines in ([e for e in self._engines if e.accepting],
                        [e for e in self._engines if not e.retiring]):
            limits = [n for n in map(EngineClient.max_request_tokens, engines) if n is not None]
            if limits:
                return min(max(limits), self.limits.context)
        return self.limits.context

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
        names = sorted(n for n in available_adapters(self._engines) if tenant.may_use(n))
        adapters = [inference_pb2.AdapterInfo(id=n, base_model_id=limits.model_id) for n in names]
        return inference_pb2.ListModelsResponse(base_model=model, adapters=adapters)

    async def generate(
        self, request: inference_pb2.GenerateRequest, caller: Caller
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams one completion: text deltas and token ids, then a last message with
        the finish reason, usage and timing. Nothing happens until the first message is
        asked for; a refusal (before or during the stream) raises RequestError. Closing
        the generator early cancels the engine work."""
        (job,) = await self._admitted([request], caller)
        async with aclosing(self._served(job)) as responses:
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
            async with aclosing(merge([self._served(job) for job in jobs])) as responses:
                async for item in responses:
                    yield item
        finally:
            for job in jobs:  # a choice closed before its stream started still holds a permit
                job.permit.release(0)

    def stall_error(self) -> RequestError | None:
        """When the current task's write was cancelled because its client stopped reading
        (--client-stall-seconds), the status the transport ends the call with; else None."""
        task = asyncio.current_task()
        if task is None or task not in self._watch.stalled:
            return None
        return RequestError(
            grpc.StatusCode.ABORTED,
            f"the client did not read its stream for {self._config.client_stall_seconds:g} s "
            "(the router's --client-stall-seconds), so the router ended it and freed its seat",
            "client_stalled",
        )

    def drain(self) -> None:
        """The router's drain is out of time: every stream ends now, those being served
        with a final ABORTED message carrying usage, those still queued UNAVAILABLE."""
        self._watch.drain()

    async def embed(
        self, request: inference_pb2.EmbedRequest, caller: Caller
    ) -> inference_pb2.EmbedResponse:
        """Validates and tokenizes the inputs, then hands them to the least loaded healthy
        engine, whose dynamic batcher groups them with other callers' (no router queue:
        the engine's embed queue has its own cap and timeouts)."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            return await self._embed(request, request_id, caller)
        except RequestError as err:
            raise self.refused(err, request_id) from None

    def refused(self, err: RequestError, request_id: str) -> RequestError:
        """Counts and logs a refusal (also one a transport makes while parsing a request),
        once however many layers pass it on, and returns it, to raise."""
        if err.counted:
            return err
        err.counted = True
        self._metrics.rejected.labels(err.reason).inc()
        log.info(
            "request_refused",
            request_id=request_id,
            code=err.code.name,
            reason=err.reason,
            message=err.message,
        )
        return err

    # ---- admission -----------------------------------------------------------

    async def _admitted(
        self, requests: list[inference_pb2.GenerateRequest], caller: Caller, per_prompt: int = 0
    ) -> list[_Job]:
        """The requests validated and admitted together, or the refusal, counted and logged."""
        arrival = time.monotonic()
        ids = [request.request_id or uuid.uuid4().hex for request in requests]
        try:
            return await self._admit(requests, ids, caller, arrival, per_prompt)
        except RequestError as err:
            raise self.refused(err, ids[0]) from None

    async def _admit(
        self,
        requests: list[inference_pb2.GenerateRequest],
        request_ids: list[str],
        caller: Caller,
        arrival: float,
        per_prompt: int = 0,
    ) -> list[_Job]:
        tenant, adapter = caller.tenant, caller.adapter
        if adapter:
            self.check_adapter_use(tenant, adapter)
        self._refresh_limits()
        valid = await self._validated(requests, request_ids, per_prompt or len(requests))
        if not self._taking(""):
            raise _no_engine()
        if adapter and not self.serves_adapter(adapter):
            silent = self.unheard_engines()
            if silent:  # it may be on an engine the router has not heard from (a restart)
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"adapter {adapter!r} is not on any engine that has reported, and {silent} "
                    "engine(s) have not reported since this router started (starting or down); "
                    "retry later",
                    "adapter_unavailable",
                )
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {adapter!r} not found on any engine; ListModels lists the adapters you "
                f"may use{VIA_HTTP}",
                "unknown_adapter",
            )
        if adapter and not self._taking(adapter):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"no engine with adapter {adapter!r} is taking requests now (down, restarting or "
                "draining); retry later",
                "adapter_unavailable",
            )
        # The choices share max_tokens; batched prompts differ, and each choice is charged
        # as the longest (refunded what it does not use when it ends).
        first = max(valid, key=lambda v: v.cost)
        if not self._taking(adapter, first.cost):  # engines' KV pools may differ
            raise self._unfit(adapter, len(first.prompt_ids), first.cost)
        queue = self._dispatcher.queue
        cost = Cost(len(first.prompt_ids), first.sampling.max_tokens, len(valid))
        permits = await self._admission.admit(tenant, cost, len(queue), queue.tokens)
        if adapter:
            self._metrics.adapter_requests.labels(adapter).inc(len(valid))
        return [_Job(v, caller, permit, arrival) for v, permit in zip(valid, permits)]

    async def _validated(
        self, requests: list[inference_pb2.GenerateRequest], request_ids: list[str], group: int
    ) -> list[ValidRequest]:
        """Each request validated, in groups of `group` choices of one prompt, tokenized
        once. With several groups (HTTP's batched prompts) a refusal of prompt k says so
        (param prompt.k)."""
        valid: list[ValidRequest] = []
        for i, (request, request_id) in enumerate(zip(requests, request_ids)):
            if i % group:  # another choice of the same prompt
                request.token_ids.ids[:] = valid[i - i % group].prompt_ids
            try:
                valid.append(await self._validator.validate(request, request_id))
            except RequestError as err:
                if group < len(requests) and (i or err.param == "prompt"):  # the prompt's fault
                    err.message = f"prompt {i // group}: {err.message}"
                    if err.param == "prompt":
                        err.param = f"prompt.{i // group}"
                raise
        return valid

    def check_adapter_use(self, tenant: Tenant, adapter: str) -> None:
        """A well-formed name (INVALID_ARGUMENT) the tenant may use (PERMISSION_DENIED)."""
        check_adapter_name(adapter)
        if not tenant.may_use(adapter):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not use adapter {adapter!r}; ListModels lists the "
                f"adapters it may use{VIA_HTTP}",
                "adapter_denied",
            )

    # ---- embeddings ----------------------------------------------------------

    async def _embed(
        self, request: inference_pb2.EmbedRequest, request_id: str, caller: Caller
    ) -> inference_pb2.EmbedResponse:
        if caller.adapter:
            raise invalid(
                f"embeddings come from the base model {self.limits.model_id!r}, not adapter "
                f"{caller.adapter!r}: leave x-adapter-id empty"
            )
        if request.pooling not in inference_pb2.Pooling.values():  # an enum value from a newer API
            raise invalid(f"pooling must be MEAN (1) or LAST (2), or unset for MEAN; got {request.pooling}")
        self._refresh_limits()
        inputs = await self._validator.embed_inputs(request)
        engines = [e for e in self._engines if e.accepting]
        if not engines:
            raise _no_engine()
        longest = max(map(len, inputs))  # engines' contexts may differ (not their KV: unused)
        engines = [e for e in engines if not 0 < e.report.max_model_len < longest]
        if not engines:  # those with a long enough context (validated) are down
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"the engines whose context holds a {longest}-token input are down, restarting or "
                "draining; retry later",
                "no_engine",
            )
        tokens = sum(map(len, inputs))
        (permit,) = await self._admission.admit(caller.tenant, Cost(tokens), 0, 0)  # tenant limits
        engine = min(engines, key=lambda e: e.load)
        used = 0  # nothing unless the engine embeds them
        try:
            reply = await engine.stub.Embed(
                engine_pb2.EngineEmbedRequest(
                    inputs=[inference_pb2.TokenIds(ids=x) for x in inputs],
                    pooling=request.pooling,
                    normalize=request.normalize,
                    priority=request.priority,
                ),
                timeout=caller.time_remaining(),
            )
            used = tokens
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                message = f"engine {engine.address} failed the request: {exc.details()}"
                code = grpc.StatusCode.UNAVAILABLE
            else:  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED: as is
                message = exc.details() or code.name
            raise RequestError(code, message, code.name.lower()) from None
        finally:
            permit.release(used)
        self._metrics.embed_requests.inc()
        self._metrics.embed_tokens.inc(tokens)
        return inference_pb2.EmbedResponse(
            request_id=request_id, embeddings=reply.embeddings, total_tokens=tokens)

    # ---- serving -------------------------------------------------------------

    async def _served(self, job: _Job) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """An admitted request, served; its permit is released and its outcome recorded
        when it ends."""
        outcome = "cancelled"  # what an exception other than ours means here
        self._watch.add(job)
        try:
            async with aclosing(self._serve(job)) as responses:
                async for response in responses:
                    if response.finish_reason != UNSPECIFIED:
                        outcome = inference_pb2.FinishReason.Name(response.finish_reason).lower()
                    job.wait("client")
                    yield response
                    job.wait("")
                    if job.interrupted == "drain" and response.finish_reason == UNSPECIFIED:
                        yield self._final(job, ABORTED)  # the drain came during that write
                        return
        except RequestError as err:
            outcome = err.reason
            if _unserved(job, outcome):  # a refusal: no engine worked on it
                raise self.refused(err, job.request.request_id) from None
            log.info("request_failed", request_id=job.request.request_id, code=err.code.name,
                     reason=err.reason, message=err.message)
            raise
        finally:
            self._watch.jobs.discard(job)
            if job.interrupted == "client_stalled":  # the write it was stuck in was cancelled
                outcome = "client_stalled"
                log.warning("client_stalled", request_id=job.request.request_id,
                            seconds=self._config.client_stall_seconds)
            elif outcome == "cancelled" and job.caller.deadline_passed(DEADLINE_CANCEL_SLACK_S):
                outcome = "deadline"  # the client's deadline ended the call (gRPC cancels it)
            job.permit.release(_used_tokens(job, outcome))
            self._record(job, outcome)

    async def _serve(self, job: _Job) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams the request from an engine, moving it to another engine (prompt + the
        tokens sent so far) when one fails, drains or stalls, at most
        max_engine_attempts engines in all."""
        job.detok = self.detokenizer(job.request.prompt_ids)
        job.stop = StopStringMatcher(job.request.stop)
        job.queued_at = job.arrival
        try:
            for attempt in range(1, self._config.max_engine_attempts + 1):
                if len(job.sent_ids) >= job.request.sampling.max_tokens:  # lost after its last
                    yield self._final(job, LENGTH)
                    return
                engine = await self._queued(job)
                try:
                    async with aclosing(self._stream(job, engine)) as responses:
                        async for response in responses:
                            yield response
                    return
                except _EngineLost as lost:
                    # No engine left to take it (one with its adapter): fail now, as a new
                    # request would be refused, rather than wait out the queue limit.
                    if (attempt == self._config.max_engine_attempts
                            or not self._taking(job.adapter, job.request.cost, job.refused_by)):
                        raise lost.error from None
                    self._moving(job, engine, attempt, lost)
                finally:
                    job.serving = None
                    engine.release(job.adapter, job.caller.tenant.name)
        except _Drained:
            yield self._final(job, ABORTED)

    async def _queued(self, job: _Job) -> EngineClient:
        job.wait("queue")
        try:
            engine = await self._wait_for_engine(job)
        except asyncio.CancelledError:
            if job.take_interrupt() != "drain":
                raise
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "the router is shutting down and the request was still queued; retry on another "
                "router",
                "router_draining",
            ) from None
        job.serving = engine
        return engine

    def _moving(self, job: _Job, engine: EngineClient, attempt: int, lost: _EngineLost) -> None:
        """Logs and counts a move to another engine; the next one resumes after the
        tokens already sent, queued ahead of later arrivals."""
        if job.sent_ids:
            self._metrics.continued.labels(lost.why).inc()
        job.queued_at = time.monotonic()
        log.warning(
            "request_continued" if job.sent_ids else "request_retried",
            request_id=job.request.request_id,
            engine=engine.address,
            attempt=attempt,
            tokens_sent=len(job.sent_ids),
            error=lost.what,
        )

    def _final(self, job: _Job, finish: int) -> inference_pb2.GenerateResponse:
        """A last message with no new token: `finish`, usage and timing."""
        assert job.detok is not None and job.stop is not None
        text = "" if job.stop.stopped else job.stop.feed(job.detok.flush()) + job.stop.flush()
        response = inference_pb2.GenerateResponse(
            request_id=job.request.request_id, text=text,
            finish_reason=STOP if job.stop.stopped else finish)
        response.usage.CopyFrom(self._usage(job))
        response.timing.CopyFrom(self._timing(job))
        return response

    def _resumed(self, job: _Job) -> tuple[list[int], engine_pb2.EngineSamplingParams]:
        """The prompt and sampling for the current engine: the original ones, or for a
        continuation the prompt + the tokens sent, with the rest of max_tokens."""
        request, sent = job.request, job.sent_ids
        job.offset = len(sent)
        if not sent:
            return list(request.prompt_ids), request.sampling
        sampling = engine_pb2.EngineSamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens -= len(sent)
        sampling.output_offset = len(sent)
        sampling.prompt_logprobs = 0  # sent with the first token already
        return [*request.prompt_ids, *sent], sampling

    async def _wait_for_engine(self, job: _Job) -> EngineClient:
        """Queues the request until the dispatcher assigns it an engine with room. The
        router's queue limit holds for the time the request spends queued in all: a
        stream moved to another engine (or a request an engine refused) re-enters the queue
        with what its earlier waits left of the limit, not a fresh one (issue 31)."""
        tenant = job.caller.tenant
        ticket = Ticket(
            job.request.priority, job.request.cost, job.arrival, job.adapter,
            tenant.name, tenant.weight, job.request.prompt_ids, avoid=frozenset(job.refused_by),
        )
        self._dispatcher.submit(ticket)
        queue_left = (job.queued_at + self._config.max_queue_seconds - job.queued_before
                      - time.monotonic())
        client_left = job.caller.time_remaining()
        timeout = queue_left if client_left is None else min(queue_left, client_left)
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                engine = await ticket.future
        except BaseException as exc:
            self._dispatcher.withdraw(ticket)
            if isinstance(exc, TimeoutError):
                raise self._queue_timeout(
                    job, client_left is not None and client_left <= queue_left
                ) from None
            raise
        finally:
            job.queued_before += time.monotonic() - job.queued_at
        job.dispatched = job.dispatched or time.monotonic()  # a retry keeps the first
        job.engine = engine.address
        if ticket.affinity is not None:
            self._metrics.adapter_dispatches.labels(ticket.affinity.label).inc()
        return engine

    def _queue_timeout(self, job: _Job, by_client: bool) -> RequestError:
        why = (
            "its deadline passed"
            if by_client
            else f"the router's queue limit is {self._config.max_queue_seconds} s"
        )
        if job.sent_ids:  # a continuation: its engine was lost and no other took it in time
            waited = time.monotonic() - job.queued_at
            total = job.queued_before + waited
            what = (f"the stream's engine was lost after {len(job.sent_ids)} tokens and the rest "
                    f"waited {waited:.2f} s for another engine to continue it ({total:.2f} s queued "
                    f"in all): {why}; the completion is incomplete, retry the request")
        else:
            waited = time.monotonic() - job.arrival
            what = f"the request waited {waited:.2f} s for an engine and was never scheduled: {why}"
        # Counted as the client's deadline when that ended it (a miss), else the queue limit.
        return RequestError(grpc.StatusCode.DEADLINE_EXCEEDED, what,
                            "deadline" if by_client else "queue_timeout")

    async def _stream(
        self, job: _Job, engine: EngineClient
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        request = job.request
        prompt_ids, sampling = self._resumed(job)
        outputs = engine.generate(
            engine_pb2.EngineGenerateRequest(
                request_id=uuid.uuid4().hex,  # unique on the engine whatever the client sent
                prompt_token_ids=prompt_ids,
                sampling=sampling,
                priority=request.priority,
                adapter=job.adapter,
                tenant=job.caller.tenant.name,
                tenant_weight=job.caller.tenant.weight,
            ),
            timeout=job.caller.time_remaining(),  # the client's deadline, passed on
        )
        detok, stop = job.detok, job.stop
        assert detok is not None and stop is not None
        job.wait("engine")
        try:
            async for out in outputs:
                job.wait("")
                # The engine gave the sequence up (its drain ran out): go on elsewhere.
                drained = out.finish_reason == ABORTED
                if drained:
                    out.finish_reason = UNSPECIFIED
                response = self._response(job, out, detok, stop)
                if response.token_ids or response.text or not drained:
                    yield response
                if drained and response.finish_reason == UNSPECIFIED:
                    raise self._lost(job, engine, "engine_drained",
                                     f"engine {engine.address} aborted it while draining")
                job.wait("engine")
                if response.finish_reason != UNSPECIFIED:
                    return  # a stop string may end it early: the finally aborts it on the engine
        except grpc.aio.AioRpcError as exc:
            raise self._engine_error(exc, engine, job) from None
        except asyncio.CancelledError:
            why = job.take_interrupt()
            if why == "engine":
                raise self._lost(job, engine, "engine_unhealthy", job.interrupt_note) from None
            if why == "drain":
                raise _Drained() from None
            raise
        finally:
            await outputs.aclose()
        raise RequestError(
            grpc.StatusCode.INTERNAL,
            f"engine {engine.address} ended the stream without a finish reason",
            "engine_error",
        )

    def _response(
        self,
        job: _Job,
        out: engine_pb2.EngineGenerateResponse,
        detok: IncrementalDetokenizer,
        stop: StopStringMatcher,
    ) -> inference_pb2.GenerateResponse:
        if out.token_ids and job.first_token is None:
            job.first_token = time.monotonic()
        tenant = job.caller.tenant
        self._dispatcher.queue.charge(tenant.name, len(out.token_ids), tenant.weight)  # fair share
        ids, text = out.token_ids, ""
        # A stop token (EOS, stop_token_ids) ends the output: its id is sent, its text is not
        # part of the text (vLLM's rule; a special token's is skipped anyway).
        shown = len(ids) - (out.finish_reason == STOP)
        if stop.active and len(ids) > 1:  # a stop string may complete before the last of them
            for n, token in enumerate(ids, 1):
                if n <= shown:
                    text += stop.feed(detok.push((token,)))
                if stop.stopped:
                    break
            ids = ids[:n]  # what comes after the token that completed it is neither sent nor billed
        else:
            text = stop.feed(detok.push(ids[:shown]))
        job.sent_ids.extend(ids)
        job.completion_tokens = job.offset + out.num_output_tokens - (len(out.token_ids) - len(ids))
        if not job.offset:  # a continuation's cache hits include the resent output
            job.cached_tokens = out.num_cached_tokens
        finish = STOP if stop.stopped else out.finish_reason
        if finish != UNSPECIFIED and not stop.stopped:
            text += stop.feed(detok.flush())  # the last bytes may still complete a stop string
            finish = STOP if stop.stopped else finish
            text += stop.flush()
        response = inference_pb2.GenerateResponse(
            request_id=job.request.request_id,
            text=text,
            token_ids=ids,
            finish_reason=finish,
        )
        if out.logprobs:  # copying an empty repeated message field costs ~1 µs a message
            response.logprobs.extend(out.logprobs[:len(ids)])
        if out.prompt_logprobs:  # the first message of a request that asked
            response.prompt_logprobs.extend(out.prompt_logprobs)
        if finish != UNSPECIFIED:
            response.usage.CopyFrom(self._usage(job))
            response.timing.CopyFrom(self._timing(job))
        return response

    def _engine_error(
        self, exc: grpc.aio.AioRpcError, engine: EngineClient, job: _Job
    ) -> Exception:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            engine.mark_failed(details)
            return self._lost(job, engine, "engine_unavailable",
                              f"engine {engine.address} is unavailable ({details})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if job.first_token is None:  # e.g. a stalled engine not yet marked unhealthy
                when = f"before engine {engine.address} produced its first token"
            else:
                when = f"during generation, after {len(job.sent_ids)} tokens"
            return RequestError(code, f"the request's deadline passed {when}", "deadline")
        if code in _ENGINE_REFUSAL_CODES:
            # Engines differ (adapter ranks, lengths, what loaded): another may take it.
            job.refused_by.add(engine.address)
            if job.sent_ids:  # the request was good where it started
                return self._lost(job, engine, "engine_refused",
                                  f"engine {engine.address} refused to continue it "
                                  f"({code.name}: {details})")
            # A format the engine's grammar engine refused names the field, as the router's checks do.
            param = "structured_output" if details.startswith("structured_output") else None
            refusal = RequestError(code, details, f"engine_{code.name.lower()}", param=param)  # when none does
            return _EngineLost(refusal, "engine_refused",
                               f"engine {engine.address} refused it ({code.name}: {details})")
        return RequestError(code, f"engine {engine.address} failed: {details}", "engine_error")

    # ---- accounting ----------------------------------------------------------

    def _usage(self, job: _Job) -> inference_pb2.Usage:
        return inference_pb2.Usage(
            prompt_tokens=len(job.request.prompt_ids),
            completion_tokens=job.completion_tokens,
            cached_prompt_tokens=job.cached_tokens,
        )

    def _timing(self, job: _Job) -> inference_pb2.Timing:
        now = time.monotonic()
        return inference_pb2.Timing(
            queue_seconds=(job.dispatched or now) - job.arrival,
            time_to_first_token_seconds=(job.first_token or now) - job.arrival,
            total_seconds=now - job.arrival,
        )

    def _record(self, job: _Job, outcome: str) -> None:
        m, now = self._metrics, time.monotonic()
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(len(job.request.prompt_ids))
        m.completion_tokens.inc(job.completion_tokens)
        if job.dispatched is not None:
            m.queue_time.observe(job.dispatched - job.arrival)
        m.latency.observe(job.arrival, job.first_token, now, job.completion_tokens)
        if job.caller.deadline is not None:
            # A miss: it did not complete (stop or length) before its deadline. One its
            # deadline ended is a miss even when that timer fired a moment early.
            missed = outcome not in ("stop", "length") and (
                outcome == "deadline" or now >= job.caller.deadline)
            m.deadline_requests.labels(job.caller.tenant.name).inc()
            m.deadline_misses.labels(job.caller.tenant.name).inc(int(missed))
        log.info(
            "request_done",
            request_id=job.request.request_id,
            tenant=job.caller.tenant.name,
            adapter=job.adapter,
            engine=job.engine,
            outcome=outcome,
            prompt_tokens=len(job.request.prompt_ids),
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
            seconds=round(now - job.arrival, 4),
        )


    def _lost(self, job: _Job, engine: EngineClient, why: str, what: str) -> _EngineLost:
        """The engine can no longer serve the stream; the error is what the client gets
        when no other engine is left to continue on."""
        if not job.sent_ids:
            message = f"{what}; retry later"
        else:
            message = (
                f"{what} after {len(job.sent_ids)} tokens and no other engine could continue "
                f"the stream (none was available, or {self._config.max_engine_attempts} engines "
                "were tried); the completion is incomplete, retry the request"
            )
        return _EngineLost(RequestError(grpc.StatusCode.UNAVAILABLE, message, why), why, what)


# How an engine refuses a request before working on it (FAILED_PRECONDITION: e.g. the
# adapter's weights failed to load); Pipeline._engine_error names them engine_<code>.
_ENGINE_REFUSAL_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED)
_ENGINE_REFUSALS = frozenset(f"engine_{code.name.lower()}" for code in _ENGINE_REFUSAL_CODES)


def _unserved(job: _Job, outcome: str) -> bool:
    """No engine worked on the request: it never left the queue (cancelled, timed out),
    or the engine refused it before its first token. Such an ending is a refusal
    (rejected_requests) and costs nothing of the budget."""
    return job.dispatched is None or (job.first_token is None and outcome in _ENGINE_REFUSALS)


def _used_tokens(job: _Job, outcome: str) -> int:
    """What a request used of its budget: its prompt and output once an engine may have
    worked on it, nothing when none did. A request cancelled after dispatch pays its
    prompt even without a token (the engine may have prefilled it)."""
    if _unserved(job, outcome):
        return 0
    return len(job.request.prompt_ids) + job.completion_tokens


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """(index, item) from several streams as items arrive. The first error ends it
    (and every stream); closing it closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    # Bounded: a stream waits while its items are not taken (a slow client), as a single
    # stream waits on its write, so its outputs merge upstream instead of queueing here.
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put((index, item))
            await queue.put((index, done))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _no_engine() -> RequestError:
    return RequestError(
        grpc.StatusCode.UNAVAILABLE, "no engine worker is available; retry later", "no_engine"
    )
