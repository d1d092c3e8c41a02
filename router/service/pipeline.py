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

Every refusal is a RequestError carrying a gRPC status; the pipeline counts and logs it
once, and each transport only translates it (gRPC: abort; HTTP: the matching status).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog
from omnibus.v1 import engine_pb2, inference_pb2
from tokenizers import Tokenizer

from omnibus.router.admission.auth import KeyStore, Tenant
from omnibus.router.admission.limits import Permit
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
# Where else a refusal that points to ListModels sends HTTP callers.
VIA_HTTP = " (GET /v1/models over HTTP)"


@dataclass(frozen=True)
class Caller:
    """Who sent a request and under which terms, whatever the transport."""

    tenant: Tenant
    adapter: str = ""  # LoRA adapter name as the client gave it; "" = the base model
    deadline: float | None = None  # monotonic seconds; None: the client set none

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


@dataclass
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

    @property
    def adapter(self) -> str:
        return self.caller.adapter


class _EngineLost(Exception):
    """The engine failed before sending any token: the request may go to another one."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


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
        self.limits = limits
        self.tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._special_ids = special_ids(tokenizer)
        self._keys = keys
        self._validator = Validator(config, limits, tokenizer)
        self._admission = admission_for(config, metrics.registry)
        self._dispatcher = dispatcher
        self._engines = engines
        self._metrics = metrics

    # ---- calls ---------------------------------------------------------------

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        """The tenant of `authorization: Bearer <key>` in the call's metadata or headers
        (lower-case names). Raises RequestError(UNAUTHENTICATED)."""
        try:
            return self._keys.authenticate(metadata)
        except RequestError as err:
            raise self.refused(err, "") from None

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
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            job = await self._admit(request, request_id, caller, arrival)
        except RequestError as err:
            raise self.refused(err, request_id) from None
        outcome = "cancelled"  # what an exception other than ours means here
        try:
            async with aclosing(self._serve(job)) as responses:
                async for response in responses:
                    if response.finish_reason != UNSPECIFIED:
                        outcome = inference_pb2.FinishReason.Name(response.finish_reason).lower()
                    yield response
        except RequestError as err:
            outcome = err.reason
            raise self.refused(err, request_id) from None
        finally:
            job.permit.release(len(job.request.prompt_ids) + job.completion_tokens)
            self._record(job, outcome)

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
        """Counts and logs a refusal (also one a transport makes while parsing a request)
        and returns it, to raise."""
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

    async def _admit(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        caller: Caller,
        arrival: float,
    ) -> _Job:
        tenant, adapter = caller.tenant, caller.adapter
        if adapter:
            self._check_adapter_use(tenant, adapter)
        valid = await self._validator.validate(request, request_id)
        if not any(e.accepting for e in self._engines):
            raise _no_engine()
        if adapter and adapter not in available_adapters(self._engines):
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {adapter!r} not found on any engine; ListModels lists the adapters you "
                f"may use{VIA_HTTP}",
                "unknown_adapter",
            )
        queue = self._dispatcher.queue
        permit = await self._admission.admit(tenant, valid.cost, len(queue), queue.tokens)
        if adapter:
            self._metrics.adapter_requests.labels(adapter).inc()
        return _Job(valid, caller, permit, arrival)

    def _check_adapter_use(self, tenant: Tenant, adapter: str) -> None:
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
        inputs = await self._validator.embed_inputs(request)
        engines = [e for e in self._engines if e.accepting]
        if not engines:
            raise _no_engine()
        tokens = sum(map(len, inputs))
        permit = await self._admission.admit(caller.tenant, tokens, 0, 0)  # tenant caps and budgets
        engine = min(engines, key=lambda e: e.load)
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
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                message = f"engine {engine.address} failed the request: {exc.details()}"
                code = grpc.StatusCode.UNAVAILABLE
            else:  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED: as is
                message = exc.details() or code.name
            raise RequestError(code, message, code.name.lower()) from None
        finally:
            permit.release(tokens)
        return inference_pb2.EmbedResponse(
            request_id=request_id, embeddings=reply.embeddings, total_tokens=tokens)

    # ---- serving -------------------------------------------------------------

    async def _serve(self, job: _Job) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams the request from an engine, moving it to another engine if the first
        one fails before producing anything."""
        for attempt in range(1, self._config.max_engine_attempts + 1):
            engine = await self._wait_for_engine(job)
            try:
                async with aclosing(self._stream(job, engine)) as responses:
                    async for response in responses:
                        yield response
                return
            except _EngineLost as lost:
                if attempt == self._config.max_engine_attempts:
                    raise lost.error from None
                log.warning(
                    "request_retried",
                    request_id=job.request.request_id,
                    engine=engine.address,
                    attempt=attempt,
                    error=lost.error.message,
                )
            finally:
                engine.release(job.adapter)

    async def _wait_for_engine(self, job: _Job) -> EngineClient:
        """Queues the request until the dispatcher assigns it an engine with room."""
        tenant = job.caller.tenant
        ticket = Ticket(
            job.request.priority, job.request.cost, job.arrival, job.adapter,
            tenant.name, tenant.weight, job.request.prompt_ids,
        )
        self._dispatcher.submit(ticket)
        queue_left = job.arrival + self._config.max_queue_seconds - time.monotonic()
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
        job.dispatched = job.dispatched or time.monotonic()  # a retry keeps the first
        job.engine = engine.address
        if ticket.affinity is not None:
            self._metrics.adapter_dispatches.labels(ticket.affinity.label).inc()
        return engine

    def _queue_timeout(self, job: _Job, by_client: bool) -> RequestError:
        waited = time.monotonic() - job.arrival
        why = (
            "its deadline passed"
            if by_client
            else f"the router's queue limit is {self._config.max_queue_seconds} s"
        )
        return RequestError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request waited {waited:.2f} s for an engine and was never scheduled: {why}",
            "queue_timeout",
        )

    async def _stream(
        self, job: _Job, engine: EngineClient
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        request = job.request
        outputs = engine.generate(
            engine_pb2.EngineGenerateRequest(
                request_id=uuid.uuid4().hex,  # unique on the engine whatever the client sent
                prompt_token_ids=request.prompt_ids,
                sampling=request.sampling,
                priority=request.priority,
                adapter=job.adapter,
                tenant=job.caller.tenant.name,
                tenant_weight=job.caller.tenant.weight,
            ),
            timeout=job.caller.time_remaining(),  # the client's deadline, passed on
        )
        detok = IncrementalDetokenizer(self.tokenizer, self._byte_ids, self._special_ids)
        stop = StopStringMatcher(request.stop)
        try:
            async for out in outputs:
                response = self._response(job, out, detok, stop)
                yield response
                if response.finish_reason != UNSPECIFIED:
                    return  # a stop string may end it early: the finally aborts it on the engine
        except grpc.aio.AioRpcError as exc:
            raise self._engine_error(exc, engine, job) from None
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
        job.completion_tokens = out.num_output_tokens
        job.cached_tokens = out.num_cached_tokens
        text = stop.feed(detok.push(out.token_ids))
        finish = STOP if stop.stopped else out.finish_reason
        if finish != UNSPECIFIED and not stop.stopped:
            text += stop.feed(detok.flush())  # the last bytes may still complete a stop string
            finish = STOP if stop.stopped else finish
            text += stop.flush()
        response = inference_pb2.GenerateResponse(
            request_id=job.request.request_id,
            text=text,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            finish_reason=finish,
        )
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
            if job.first_token is None:
                return _EngineLost(
                    RequestError(
                        code,
                        f"engine {engine.address} is unavailable ({details}); retry later",
                        "engine_unavailable",
                    )
                )
            return RequestError(
                code,
                f"engine {engine.address} became unavailable mid-stream after "
                f"{job.completion_tokens} tokens ({details}); the completion is incomplete, "
                "retry the request",
                "engine_unavailable",
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestError(code, "the request's deadline passed during generation", "deadline")
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,  # e.g. the adapter's weights failed to load
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ):
            return RequestError(code, details, f"engine_{code.name.lower()}")
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
            # A miss: it did not complete (stop or length) before its deadline.
            missed = outcome not in ("stop", "length") and now >= job.caller.deadline
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


def _no_engine() -> RequestError:
    return RequestError(
        grpc.StatusCode.UNAVAILABLE, "no engine worker is available; retry later", "no_engine"
    )
