"""`omnibus.v1.Engine` over an `AsyncEngine`: requests in, tokens out, load reports,
embeddings and adapter calls.

The step loop runs on its own thread or in a process of its own; this asyncio service
only moves requests in and tokens out, so it never blocks on a step. Routers use
Session (session.py): one stream per router carries its adds and aborts in, and one
update per step with every new token of its requests out. Generate, one call per
request, stays for tools and tests; it is served by a SessionStream of its own with that
one request, its gRPC deadline folded into deadline_ms first. So every request is
admitted by `admit`, has its deadline kept by the one timer (`SessionStream.add`: the
sequence is aborted when it passes, freeing its KV blocks), ends through the one registry
(registry.py) and has its failures answered by the one mapping (replies.py). While
draining, new requests get UNAVAILABLE.

LoRA adapters: a request names one (loaded in the background on first use); load
reports carry the adapters in device slots, in host memory and on disk (for the
router's adapter-affine routing) and each known adapter's prefix-cache salt (for its
prefix-aware routing); LoadAdapter / UnloadAdapter / ListAdapters manage them at run
time through the step loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import NoReturn

import grpc
import structlog
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2

from omnibus.engine.engine import EngineStats
from omnibus.engine.lora import AdapterInventory
from omnibus.engine.serving.async_engine import AsyncEngine, StepLoopDown
from omnibus.engine.serving.batcher import QueueFullError, QueueTimeoutError
from omnibus.engine.serving.catalog import AdapterCatalog
from omnibus.engine.serving.metrics import EngineMetrics
from omnibus.engine.serving.registry import Live, Registry
from omnibus.engine.serving.replies import SHUTTING_DOWN, STALLED, Refusal, error_status, status_code
from omnibus.engine.serving.session import SessionStream

log = structlog.get_logger("engine.server")

DEFAULT_REPORT_INTERVAL_S = 0.05
MIN_REPORT_INTERVAL_S = 0.01
HEARTBEAT_S = 1.0  # a report at least this often, changed or not: routers treat silence as death
ABORT_WAIT_S = 2.0  # after the drain grace, how long aborted streams get to report ABORTED
MAX_DEADLINE_MS = 2**32 - 1  # deadline_ms is a uint32 (~49.7 days)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(
        self, aengine: AsyncEngine, metrics: EngineMetrics, catalog: AdapterCatalog | None = None
    ) -> None:
        self.aengine = aengine
        self.catalog = catalog or AdapterCatalog(aengine.config.adapter_dir)
        self.requests = Registry(metrics)  # the requests being served
        self._sessions: set[SessionStream] = set()  # the routers' open Session streams
        self.draining = False
        self.stalled = False  # the watchdog saw a step run past its limit

    @property
    def num_active(self) -> int:
        return len(self.requests)

    # ---- requests ------------------------------------------------------------

    def admit(self, msg: engine_pb2.EngineGenerateRequest, session: SessionStream) -> Live:
        """Registers `msg`'s request, served by `session` (a router's, or a Generate call's
        own); raises Refusal (counted in the metrics) when the engine will not take it."""
        code, message = self._refusal(msg)
        if code is not None:
            self.requests.refused(code)
            raise Refusal(code, message)
        return self.requests.open(msg.request_id, msg.adapter, session, msg.handle)

    def _refusal(
        self, request: engine_pb2.EngineGenerateRequest
    ) -> tuple[grpc.StatusCode | None, str]:
        unavailable = self._unavailable()
        if unavailable is not None:
            return unavailable
        if not request.request_id:
            return grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"
        if request.request_id in self.requests:
            return (
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {request.request_id!r} is already streaming",
            )
        if self.aengine.error is not None:
            return self._crashed()
        return None, ""

    def _unavailable(self) -> tuple[grpc.StatusCode, str] | None:
        """Why this engine takes no new work now (draining, stalled), or None."""
        if self.draining:
            return grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN
        if self.stalled:
            return grpc.StatusCode.UNAVAILABLE, STALLED
        return None

    def _crashed(self) -> tuple[grpc.StatusCode, str]:
        """What a crashed step loop answers: UNAVAILABLE, so routers go elsewhere."""
        return grpc.StatusCode.UNAVAILABLE, f"the engine step loop has crashed: {self.aengine.error!r}"

    async def Session(
        self, requests: AsyncIterator[engine_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionUpdate]:
        session = SessionStream(self, asyncio.get_running_loop())
        self._sessions.add(session)
        try:
            async with aclosing(session.run(requests)) as updates:
                async for update in updates:
                    yield update
        finally:
            self._sessions.discard(session)

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        stream = SessionStream(self, asyncio.get_running_loop(), merges=False)
        msg = _with_call_deadline(request, context.time_remaining())
        async with aclosing(stream.one(msg)) as entries:
            async for entry in entries:
                if entry.status_code:  # a refusal or failure: the call's status
                    await context.abort(status_code(entry.status_code), entry.status_message)
                yield entry

    # ---- embeddings, load and stats --------------------------------------------

    async def Embed(
        self, request: engine_pb2.EngineEmbedRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineEmbedResponse:
        unavailable = self._unavailable()
        if unavailable is not None:
            await context.abort(*unavailable)
        if request.pooling not in inference_pb2.Pooling.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"pooling must be MEAN (1) or LAST (2), or unset for MEAN; got {request.pooling}")
        pooling = "last" if request.pooling == inference_pb2.LAST else "mean"
        try:
            vectors = await self.aengine.embed(
                [list(x.ids) for x in request.inputs], pooling, request.normalize,
                request.priority, request.queue_timeout_ms or None)
        except (QueueFullError, QueueTimeoutError, ValueError, StepLoopDown) as exc:
            await context.abort(*error_status(exc))
        return engine_pb2.EngineEmbedResponse(embeddings=[
            inference_pb2.Embedding(values=v, num_tokens=len(x.ids))
            for v, x in zip(vectors, request.inputs)])

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = max(
            request.interval_ms / 1000 or DEFAULT_REPORT_INTERVAL_S, MIN_REPORT_INTERVAL_S
        )
        last, last_sent = None, 0.0
        while self.aengine.error is None and not self.stalled:
            stats = self.aengine.stats()
            report = self._report(stats)
            now = time.monotonic()
            if report != last or now - last_sent >= HEARTBEAT_S:
                sent = report
                if last is None or report.prefix_generation != last.prefix_generation:
                    # The keys travel only when they changed (the router keeps the last set).
                    sent = engine_pb2.LoadReport()
                    sent.CopyFrom(report)
                    sent.prefix_block_keys.extend(stats.prefix_block_keys)
                yield sent
                last, last_sent = report, now
            await asyncio.sleep(interval)
        if self.aengine.error is None:  # stalled: routers mark the engine unhealthy
            await context.abort(grpc.StatusCode.UNAVAILABLE, STALLED)
        await context.abort(*self._crashed())

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        stats = self.aengine.stats()
        return engine_pb2.StatsResponse(
            load=self._report(stats),
            num_cached_blocks=stats.num_cached_blocks,
            num_steps=stats.num_steps,
            num_requests=self.requests.num_requests,
            num_active_streams=len(self.requests),
            num_preemptions=stats.num_preemptions,
            num_prefix_cache_hit_blocks=stats.num_prefix_cache_hit_blocks,
            slots_stepped=stats.slots_stepped,
            useful_tokens=stats.useful_tokens,
            kv_tokens_stored=stats.kv_tokens_stored,
            kv_tokens_reserved=stats.kv_tokens_reserved,
            kv_transfer=None if stats.kv_transfer is None else engine_pb2.KvTransferStats(
                **dataclasses.asdict(stats.kv_transfer)),
        )

    def load_report(self) -> engine_pb2.LoadReport:
        return self._report(self.aengine.stats())

    def _report(self, stats: EngineStats) -> engine_pb2.LoadReport:
        config = self.aengine.config
        return engine_pb2.LoadReport(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            max_model_len=self.aengine.max_model_len,
            draining=self.draining,
            resident_adapters=sorted(stats.resident_adapters),
            cached_adapters=stats.cached_adapters,
            available_adapters=self.catalog.names,
            prefix_generation=stats.prefix_generation,
            adapter_salts=dict(stats.adapter_salts),
            role=config.role,
            kv_transfer=config.kv_transfer != "none",
            kv_layout="" if stats.kv_transfer is None else stats.kv_transfer.layout,
        )

    # ---- adapters ------------------------------------------------------------

    async def LoadAdapter(
        self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoadAdapterResponse:
        try:
            loaded = await self.aengine.load_adapter(request.adapter)
        except (ValueError, LookupError, RuntimeError) as exc:
            await self._adapter_refusal(context, "load", request.adapter, exc)
        await self.catalog.refresh()
        log.info("adapter_loaded", adapter=loaded.adapter, resident=loaded.resident,
                 was_loaded=loaded.was_loaded)
        return engine_pb2.LoadAdapterResponse(
            adapter=loaded.adapter, resident=loaded.resident, was_loaded=loaded.was_loaded
        )

    async def UnloadAdapter(
        self, request: engine_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnloadAdapterResponse:
        try:
            was_loaded = await self.aengine.unload_adapter(request.adapter)
        except (ValueError, LookupError, RuntimeError) as exc:
            await self._adapter_refusal(context, "unload", request.adapter, exc)
        await self.catalog.refresh()
        log.info("adapter_unloaded", adapter=request.adapter, was_loaded=was_loaded)
        return engine_pb2.UnloadAdapterResponse(adapter=request.adapter, was_loaded=was_loaded)

    async def ListAdapters(
        self, request: engine_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ListAdaptersResponse:
        try:
            inventory = await self.aengine.list_adapters()
        except RuntimeError as exc:
            await self._adapter_refusal(context, "list", "", exc)
        await self.catalog.refresh()
        config = self.aengine.config
        reply = engine_pb2.ListAdaptersResponse(
            resident=inventory.resident,
            cached=inventory.cached,
            available=self.catalog.names,
            enabled=config.adapter_dir is not None,
        )
        if config.adapter_dir is not None:
            reply.max_loras = config.max_loras
            reply.max_cpu_loras = config.max_cpu_loras
            reply.max_lora_rank = config.max_lora_rank
        reply.residency.extend(residency(inventory, self.aengine.stats()))
        return reply

    async def _adapter_refusal(
        self, context: grpc.aio.ServicerContext, action: str, adapter: str, exc: Exception
    ) -> NoReturn:
        code, message = error_status(exc)
        log.info("adapter_refused", action=action, adapter=adapter[:140], code=code.name,
                 message=message)
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    # ---- stopping --------------------------------------------------------------

    async def end_sessions(self, wait: float = 0.5) -> None:
        """Ends the routers' Session streams (OK, after what is pending), so the server's
        stop does not cancel their handlers mid-write (gRPC logs those as unhandled
        errors with a traceback); a router reconnects to the next engine."""
        for session in self._sessions:
            session.close()
        await _wait_until(lambda: not self._sessions, wait)

    async def drain(self, grace: float) -> None:
        """Refuses new requests, lets in-flight ones finish for `grace` seconds, then
        aborts the rest (their streams end with finish reason ABORTED). With
        --kv-transfer every request ends at once instead (live migration): running ones
        with the handle of their KV, held here until the engines going on with them have
        read it (within `grace`)."""
        self.draining = True
        end = time.monotonic() + grace
        if self.aengine.config.kv_transfer != "none" and self.requests:
            log.info("drain_migrating", requests=len(self.requests))
            self.aengine.migrate()
        if not await _wait_until(lambda: not self.requests, grace):
            log.warning("drain_grace_expired", aborting=sorted(self.requests.ids()))
            for rid in self.requests.ids():
                self.aengine.abort(rid)
            await _wait_until(lambda: not self.requests, ABORT_WAIT_S)
        if not await _wait_until(self._released, max(0.0, end - time.monotonic())):
            log.warning("drain_kv_still_held", kv=self.aengine.stats().kv_transfer)

    def _released(self) -> bool:
        """No KV is held here for other engines."""
        kv = self.aengine.stats().kv_transfer
        return kv is None or kv.held == 0


def _with_call_deadline(
    request: engine_pb2.EngineGenerateRequest, remaining: float | None
) -> engine_pb2.EngineGenerateRequest:
    """A Generate call's request as a session's add: the call's gRPC deadline (`remaining`
    seconds, None: none) folded into deadline_ms, the earlier of the two counting, and no
    handle (Generate's messages carry none)."""
    msg = engine_pb2.EngineGenerateRequest()
    msg.CopyFrom(request)
    msg.handle = 0
    if remaining is not None:
        ms = min(max(1, math.ceil(remaining * 1000)), MAX_DEADLINE_MS)  # 0 would mean none
        msg.deadline_ms = min(msg.deadline_ms, ms) if msg.deadline_ms else ms
    return msg


async def _wait_until(done: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    """Polls `done()` until it is true (True) or `timeout` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(poll)
    return True


def residency(inventory: AdapterInventory, stats: EngineStats) -> list[engine_pb2.AdapterResidency]:
    """Each adapter in memory or counted since start: its tier (device, host, else disk),
    the sequences pinning its slot, its loads and evictions per tier."""
    pins = dict(inventory.pins)
    loads = dict(stats.adapter_loads)
    evictions = {(name, tier): n for name, tier, n in stats.adapter_evictions}
    resident = set(inventory.resident)
    names = sorted(set(inventory.cached) | resident | set(loads) | {name for name, _ in evictions})
    return [engine_pb2.AdapterResidency(
        adapter=name, tier="device" if name in resident else "host" if name in inventory.cached else "disk",
        pins=pins.get(name, 0), loads=loads.get(name, 0),
        device_evictions=evictions.get((name, "device"), 0), host_evictions=evictions.get((name, "host"), 0),
    ) for name in names]
