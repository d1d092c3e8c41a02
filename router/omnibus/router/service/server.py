"""The router process: the public `omnibus.v1.Inference` service (gRPC) in front of
engines, on the transport-neutral request pipeline (pipeline.py), plus health, the
admin API and metrics."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from omnibus.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc

from omnibus.common.grpc_server import (
    LIVENESS,
    Service,
    build_server,
    set_health,
    stop_on_signal,
)
from omnibus.common.heap import freeze_heap
from omnibus.router.admission.auth import KeyStore
from omnibus.router.admission.validation import ModelLimits, load_tokenizer
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import ADAPTER_HEADER
from omnibus.router.dispatch.discovery import EngineDiscovery
from omnibus.router.dispatch.dispatcher import Dispatcher, Ticket
from omnibus.router.dispatch.fleet import Fleet
from omnibus.router.dispatch.queue import RequestQueue
from omnibus.router.http.app import OpenAIFront
from omnibus.router.http.chat_template import ChatTemplate
from omnibus.router.service.admin import AdminService
from omnibus.router.service.errors import RequestError
from omnibus.router.service.metrics import RouterMetrics
from omnibus.router.service.pipeline import Caller, Pipeline

log = structlog.get_logger("router")

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """omnibus.v1.Inference over gRPC: metadata and deadline in, the pipeline's
    messages out, its RequestError as the call's status."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        try:
            tenant = self._pipeline.authenticate(context.invocation_metadata() or ())
        except RequestError as err:
            await context.abort(err.code, err.message)
        return self._pipeline.list_models(tenant)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        # Writes with context.write, not by yielding: a write the stall watch cancels is
        # then ours to end with a status (a cancelled generator's call just goes silent).
        try:
            caller = self._caller(context, request.request_id)
            async with aclosing(self._pipeline.generate(request, caller)) as responses:
                async for response in responses:
                    await context.write(response)
        except RequestError as err:
            await context.abort(err.code, err.message)
        except asyncio.CancelledError:
            stalled = self._pipeline.stall_error()
            if stalled is None:
                raise
            asyncio.current_task().uncancel()
            await context.abort(stalled.code, stalled.message)

    async def Embed(
        self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.EmbedResponse:
        try:
            return await self._pipeline.embed(request, self._caller(context, request.request_id))
        except RequestError as err:
            await context.abort(err.code, err.message)

    def _caller(self, context: grpc.aio.ServicerContext, request_id: str) -> Caller:
        metadata = context.invocation_metadata() or ()
        left = context.time_remaining()
        return Caller(
            tenant=self._pipeline.authenticate(metadata, request_id),
            adapter=str(next((v for k, v in metadata if k == ADAPTER_HEADER), "")),
            deadline=None if left is None else time.monotonic() + left,
        )


# ---- the process ---------------------------------------------------------------


class _HealthTracker:
    """SERVING while some engine takes requests; NOT_SERVING otherwise or when draining."""

    def __init__(self, servicer: health.aio.HealthServicer, fleet: Fleet) -> None:
        self._servicer = servicer
        self._fleet = fleet
        self._serving: bool | None = None
        self.draining = False
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """NOT_SERVING until an engine reports (the servicer starts out SERVING)."""
        self._serving = False
        await self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def update(self) -> None:
        """Re-evaluates the status; call on every engine change (it is cheap)."""
        serving = not self.draining and self._fleet.serving()
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
    stop = stop_on_signal()
    tokenizer = load_tokenizer(config.model)
    limits = ModelLimits.load(config)
    chat = ChatTemplate.load(config.model) if config.http_port else None
    keys = KeyStore.open(config.keys_file, config.tenant_limits, config.admin_key_file)
    queue: RequestQueue[Ticket] = RequestQueue(config.priority_aging_seconds, config.queue_policy)
    fleet = Fleet()
    dispatcher = Dispatcher(fleet, queue, config.prefix_weight)
    health_servicer = health.aio.HealthServicer()
    tracker = _HealthTracker(health_servicer, fleet)
    fleet.subscribe(dispatcher.notify)
    fleet.subscribe(tracker.update)
    discovery = EngineDiscovery(config, fleet)
    metrics = RouterMetrics(queue, fleet, limits.model_id)
    pipeline = Pipeline(config, limits, tokenizer, keys, dispatcher, fleet, metrics)
    service = InferenceService(pipeline)
    admin = AdminService(keys, fleet)
    if config.metrics_port:  # first: a port in use fails before anything listens
        metrics.serve(config.metrics_port)
    server = _grpc_server(config, service, admin, health_servicer)
    http = OpenAIFront(pipeline, config, chat) if config.http_port else None
    if http is not None:
        await http.start()
    await tracker.start()
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    dispatcher.start()
    discovery.start()
    freeze_heap()
    log.info(
        "router_serving",
        port=config.port,
        http_port=config.http_port or None,
        http_tls=config.http_tls_cert is not None,
        http_client_certs=config.http_tls_client_ca is not None,
        chat_template=chat is not None,
        engines=list(config.engines),
        model=limits.model_id,
        context=limits.context,
        tenants=[t.name for t in keys.tenants],
        admin_api=keys.admin_enabled,
    )
    await stop.wait()
    log.info("router_draining", seconds=config.drain_seconds)
    tracker.draining = True
    tracker.update()
    await _drain(config, server, http, pipeline)
    await dispatcher.close()
    await discovery.close()
    await pipeline.close()
    log.info("router_stopped")


# After the drain time, each stream gets this long to take its final ABORTED message.
_FINAL_MESSAGE_SECONDS = 2.0


async def _drain(
    config: RouterConfig, server: grpc.aio.Server, http: OpenAIFront | None, pipeline: Pipeline
) -> None:
    """New calls are refused at once; streams get config.drain_seconds to finish, then
    each ends with a final ABORTED message carrying its usage (never a bare
    'Cancelling all calls')."""
    stopping = asyncio.gather(
        server.stop(config.drain_seconds + _FINAL_MESSAGE_SECONDS),
        *([http.stop()] if http else []),
    )
    try:
        await asyncio.wait_for(asyncio.shield(stopping), config.drain_seconds)
    except TimeoutError:
        log.info("router_drain_expired", seconds=config.drain_seconds)
        pipeline.drain()
        await stopping


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
    options = [
        ("grpc.max_receive_message_length", 2 * config.max_request_bytes + 4096),
        # Pings find a client whose host vanished while its stream was idle; one that
        # stops reading is found by the pipeline (--client-stall-seconds).
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    return build_server(config.host, config.port, services, health_servicer, options,
                        config.public_security())
