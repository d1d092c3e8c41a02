"""The router process: the public `omnibus.v1.Inference` service in front of engines.

A request's path: authenticate → check the adapter (x-adapter-id: name, the tenant's
list, some engine has it) → validate and tokenize → admit (tenant limits, queue
caps) → wait in the priority queue until an engine has room (with the adapter,
preferring one where it is resident) → stream the engine's
tokens back as text (incremental detokenization, stop strings) → a last message with
finish reason, usage and timing. A client cancel or deadline cancels the engine call,
which makes the engine free the sequence's KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from omnibus.v1 import admin_pb2, admin_pb2_grpc, engine_pb2, inference_pb2, inference_pb2_grpc
from tokenizers import Tokenizer

from omnibus.router.dispatch.adapters import ADAPTER_HEADER, check_adapter_name
from omnibus.router.service.admin import AdminService
from omnibus.router.admission.limits import Permit
from omnibus.router.admission.store import admission_for
from omnibus.router.admission.auth import KeyStore, Tenant
from omnibus.common.grpc_server import Service, build_server, set_health, wait_for_signal
from omnibus.router.config import RouterConfig
from omnibus.router.text.detokenizer import IncrementalDetokenizer, byte_fallback_ids, special_ids
from omnibus.router.dispatch.discovery import EngineDiscovery
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.engines import EngineClient, available_adapters
from omnibus.router.service.errors import RequestError, invalid
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.dispatch.queue import RequestQueue
from omnibus.router.text.stop import StopStringMatcher
from omnibus.router.admission.validation import ModelLimits, Validator, ValidRequest, load_tokenizer

log = structlog.get_logger("router")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
STOP, UNSPECIFIED = inference_pb2.STOP, inference_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class _Job:
    """One admitted request while it is being served."""

    request: ValidRequest
    tenant: Tenant
    adapter: str
    permit: Permit
    arrival: float  # monotonic seconds
    dispatched: float | None = None
    first_token: float | None = None
    engine: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0


class _EngineLost(Exception):
    """The engine failed before sending any token: the request may go to another one."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


class InferenceService(inference_pb2_grpc.InferenceServicer):
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
        self._limits = limits
        self._tokenizer = tokenizer
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._special_ids = special_ids(tokenizer)
        self._keys = keys
        self._validator = Validator(config, limits, tokenizer)
        self._admission = admission_for(config, metrics.registry)
        self._dispatcher = dispatcher
        self._engines = engines
        self._metrics = metrics

    # ---- RPCs ----------------------------------------------------------------

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        try:
            tenant = self._keys.authenticate(context.invocation_metadata() or ())
        except RequestError as err:
            await self._refuse(context, err, "")
        limits = self._limits
        model = inference_pb2.ModelInfo(
            id=limits.model_id,
            max_context_length=limits.context,
            vocab_size=limits.vocab_size,
            max_tokens_limit=limits.max_tokens,
        )
        names = sorted(n for n in available_adapters(self._engines) if tenant.may_use(n))
        adapters = [inference_pb2.AdapterInfo(id=n, base_model_id=limits.model_id) for n in names]
        return inference_pb2.ListModelsResponse(base_model=model, adapters=adapters)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            job = await self._admit(request, request_id, context, arrival)
        except RequestError as err:
            await self._refuse(context, err, request_id)
            return
        outcome = "cancelled"  # what an exception other than ours means here
        try:
            async with aclosing(self._serve(job, context)) as responses:
                async for response in responses:
                    if response.finish_reason != UNSPECIFIED:
                        outcome = inference_pb2.FinishReason.Name(response.finish_reason).lower()
                    yield response
        except RequestError as err:
            outcome = err.reason
            await self._refuse(context, err, request_id)
        finally:
            job.permit.release(len(job.request.prompt_ids) + job.completion_tokens)
            self._record(job, outcome)

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        """Validates and tokenizes the inputs, then hands them to the least loaded healthy
        engine, whose dynamic batcher groups them with other callers' (no router queue:
        the engine's embed queue has its own cap and timeouts)."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            metadata = context.invocation_metadata() or ()
            tenant = self._keys.authenticate(metadata)
            if next((v for k, v in metadata if k == ADAPTER_HEADER), ""):
                raise invalid("embeddings come from the base model: leave x-adapter-id empty")
            inputs = await self._validator.embed_inputs(request)
            engines = [e for e in self._engines if e.accepting]
            if not engines:
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   "no engine worker is available; retry later", "no_engine")
            tokens = sum(map(len, inputs))
            permit = await self._admission.admit(tenant, tokens, 0, 0)  # tenant caps and budgets
        except RequestError as err:
            await self._refuse(context, err, request_id)
        engine = min(engines, key=lambda e: e.load)
        try:
            reply = await engine.stub.Embed(
                engine_pb2.EngineEmbedRequest(
                    inputs=[inference_pb2.TokenIds(ids=x) for x in inputs],
                    pooling=request.pooling,
                    normalize=request.normalize,
                    priority=request.priority,
                ),
                timeout=context.time_remaining(),
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                message = f"engine {engine.address} failed the request: {exc.details()}"
                code = grpc.StatusCode.UNAVAILABLE
            else:  # INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED, CANCELLED: as is
                message = exc.details() or code.name
            await self._refuse(context, RequestError(code, message, code.name.lower()), request_id)
        finally:
            permit.release(tokens)  # _refuse above raises, so the permit exists here
        return inference_pb2.EmbedResponse(
            request_id=request_id, embeddings=reply.embeddings, total_tokens=tokens)

    # ---- admission -----------------------------------------------------------

    async def _admit(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        context: grpc.aio.ServicerContext,
        arrival: float,
    ) -> _Job:
        metadata = context.invocation_metadata() or ()
        tenant = self._keys.authenticate(metadata)
        adapter = str(next((v for k, v in metadata if k == ADAPTER_HEADER), ""))
        if adapter:
            self._check_adapter_use(tenant, adapter)
        valid = await self._validator.validate(request, request_id)
        if not any(e.accepting for e in self._engines):
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "no engine worker is available; retry later",
                "no_engine",
            )
        if adapter and adapter not in available_adapters(self._engines):
            raise RequestError(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {adapter!r} not found on any engine; ListModels lists the adapters "
                "you may use",
                "unknown_adapter",
            )
        queue = self._dispatcher.queue
        permit = await self._admission.admit(tenant, valid.cost, len(queue), queue.tokens)
        if adapter:
            self._metrics.adapter_requests.labels(adapter).inc()
        return _Job(valid, tenant, adapter, permit, arrival)

    def _check_adapter_use(self, tenant: Tenant, adapter: str) -> None:
        """A well-formed name (INVALID_ARGUMENT) the tenant may use (PERMISSION_DENIED)."""
        check_adapter_name(adapter)
        if not tenant.may_use(adapter):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {tenant.name!r} may not use adapter {adapter!r}; ListModels lists the "
                "adapters it may use",
                "adapter_denied",
            )

    async def _refuse(
        self, context: grpc.aio.ServicerContext, err: RequestError, request_id: str
    ) -> None:
        self._metrics.rejected.labels(err.reason).inc()
        log.info(
            "request_refused",
            request_id=request_id,
            code=err.code.name,
            reason=err.reason,
            message=err.message,
        )
        await context.abort(err.code, err.message)

    # ---- serving -------------------------------------------------------------

    async def _serve(
        self, job: _Job, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """Streams the request from an engine, moving it to another engine if the first
        one fails before producing anything."""
        for attempt in range(1, self._config.max_engine_attempts + 1):
            engine = await self._wait_for_engine(job, context)
            try:
                async with aclosing(self._stream(job, engine, context)) as responses:
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

    async def _wait_for_engine(self, job: _Job, context: grpc.aio.ServicerContext) -> EngineClient:
        """Queues the request until the dispatcher assigns it an engine with room."""
        ticket = Ticket(job.request.priority, job.request.cost, job.arrival, job.adapter)
        self._dispatcher.submit(ticket)
        queue_left = job.arrival + self._config.max_queue_seconds - time.monotonic()
        client_left = context.time_remaining()
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
        self, job: _Job, engine: EngineClient, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        request = job.request
        call = engine.stub.Generate(
            engine_pb2.EngineGenerateRequest(
                request_id=uuid.uuid4().hex,  # unique on the engine whatever the client sent
                prompt_token_ids=request.prompt_ids,
                sampling=request.sampling,
                priority=request.priority,
                adapter=job.adapter,
            ),
            timeout=context.time_remaining(),  # the client's deadline, passed on
        )
        detok = IncrementalDetokenizer(self._tokenizer, self._byte_ids, self._special_ids)
        stop = StopStringMatcher(request.stop)
        try:
            async for out in call:
                response = self._response(job, out, detok, stop)
                yield response
                if response.finish_reason != UNSPECIFIED:
                    return  # a stop string may end it early: the finally cancels the engine call
        except grpc.aio.AioRpcError as exc:
            raise self._engine_error(exc, engine, job) from None
        finally:
            call.cancel()
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
        log.info(
            "request_done",
            request_id=job.request.request_id,
            tenant=job.tenant.name,
            adapter=job.adapter,
            engine=job.engine,
            outcome=outcome,
            prompt_tokens=len(job.request.prompt_ids),
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
            seconds=round(now - job.arrival, 4),
        )


# ---- the process ---------------------------------------------------------------


class _HealthTracker:
    """SERVING while some engine takes requests; NOT_SERVING otherwise or when draining."""

    def __init__(self, servicer: health.aio.HealthServicer, engines: list[EngineClient]) -> None:
        self._servicer = servicer
        self._engines = engines
        self._serving: bool | None = None
        self.draining = False
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """NOT_SERVING until an engine reports (the servicer starts out SERVING)."""
        self._serving = False
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def update(self) -> None:
        """Re-evaluates the status; call on every engine change (it is cheap)."""
        serving = not self.draining and any(e.accepting for e in self._engines)
        if serving == self._serving:
            return
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        task = asyncio.get_running_loop().create_task(self._set(status))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _set(self, status: int) -> None:
        await set_health(self._servicer, (SERVICE_NAME,), status)


async def serve(config: RouterConfig) -> None:
    """Runs the router until SIGTERM or SIGINT, then drains for config.drain_seconds."""
    tokenizer = load_tokenizer(config.model)
    limits = ModelLimits.load(config)
    keys = KeyStore.open(config.keys_file, config.tenant_limits, config.admin_key_file)
    queue: RequestQueue[Ticket] = RequestQueue(config.priority_aging_seconds)
    engines: list[EngineClient] = []
    dispatcher = Dispatcher(engines, queue)
    health_servicer = health.aio.HealthServicer()
    tracker = _HealthTracker(health_servicer, engines)

    def on_engine_change() -> None:
        dispatcher.notify()
        tracker.update()

    discovery = EngineDiscovery(config, engines, on_engine_change)
    metrics = RouterMetrics(queue, engines)
    service = InferenceService(config, limits, tokenizer, keys, dispatcher, engines, metrics)
    admin = AdminService(keys, engines)
    server = _grpc_server(config, service, admin, health_servicer)
    await tracker.start()
    await server.start()
    dispatcher.start()
    discovery.start()
    if config.metrics_port:
        metrics.serve(config.metrics_port)
    log.info(
        "router_serving",
        port=config.port,
        engines=list(config.engines),
        model=limits.model_id,
        context=limits.context,
        tenants=[t.name for t in keys.tenants],
        admin_api=keys.admin_enabled,
    )
    await wait_for_signal()
    log.info("router_draining", seconds=config.drain_seconds)
    tracker.draining = True
    tracker.update()
    await server.stop(config.drain_seconds)
    await dispatcher.close()
    await discovery.close()
    log.info("router_stopped")


def _grpc_server(
    config: RouterConfig,
    service: InferenceService,
    admin: AdminService,
    health_servicer: health.aio.HealthServicer,
) -> grpc.aio.Server:
    services = (
        Service(service, inference_pb2_grpc.add_InferenceServicer_to_server, SERVICE_NAME),
        Service(admin, admin_pb2_grpc.add_AdminServicer_to_server, ADMIN_SERVICE_NAME),
    )
    # gRPC's own cap sits above ours so that an oversized request gets our clear
    # INVALID_ARGUMENT rather than a bare RESOURCE_EXHAUSTED.
    options = [("grpc.max_receive_message_length", 2 * config.max_request_bytes + 4096)]
    return build_server(config.host, config.port, services, health_servicer, options)
