"""The engine worker's gRPC server: `omnibus.v1.Engine` over an `AsyncEngine`.

The step loop runs on its own thread or in a process of its own (AsyncEngine over a
ThreadCore or a ProcessCore, `--step-loop`); this asyncio server only moves requests in
and tokens out, so it never blocks on a step. Routers use Session: one
stream per router carries its adds and aborts in, and one update per step with every new
token of its requests out (AsyncEngine delivers each step's outputs to the session in one
call); Generate, one stream per request, stays for tools and tests. Both paths share one
registry of the requests being served (`EngineService._live`). A request's deadline
(deadline_ms, or Generate's gRPC deadline) aborts the sequence when it passes, freeing
its KV blocks. SIGTERM drains: health goes NOT_SERVING, new requests get
UNAVAILABLE, in-flight streams get `drain_seconds` to finish and are aborted after.

LoRA adapters: Generate names one (loaded in the background on first use), load
reports carry the adapters in device slots, in host memory and on disk (for the
router's adapter-affine routing) and each known adapter's prefix-cache salt (for its
prefix-aware routing), and LoadAdapter / UnloadAdapter / ListAdapters
manage them at run time through the step loop (AsyncEngine).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, cast

import grpc
import structlog
from grpc_health.v1 import health, health_pb2
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2
from prometheus_client import (
    CollectorRegistry,
    Counter,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from omnibus.common.grpc_server import Service, build_server, set_health, stop_on_signal
from omnibus.common.heap import freeze_heap
from omnibus.common.metrics import RequestLatency, serve_metrics
from omnibus.common.security import ServerSecurity
from omnibus.engine.serving.async_engine import AdapterStateError, AsyncEngine, Delivery, Refused, StepLoopDown
from omnibus.engine.serving.batcher import BatcherConfig, QueueFullError, QueueTimeoutError
from omnibus.common.fatal import EXIT_CODE, exit_process
from omnibus.engine.serving.watchdog import Watchdog, WatchdogConfig
from omnibus.engine.engine import Engine, EngineStats, UnknownAdapterError
from omnibus.engine.config import EngineConfig
from omnibus.engine.lora import list_adapter_names
from omnibus.engine.serving.core import ProcessCore, ThreadCore
from omnibus.engine.worker.sampling import SamplingParams
from omnibus.engine.core.sequence import RequestOutput

log = structlog.get_logger("engine.server")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
DEFAULT_REPORT_INTERVAL_S = 0.05
MIN_REPORT_INTERVAL_S = 0.01
HEARTBEAT_S = 1.0  # a report at least this often, changed or not: routers treat silence as death
ABORT_WAIT_S = 2.0  # after the drain grace, how long aborted streams get to report ABORTED
ADAPTER_LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CATALOG_REFRESH_S = 2.0  # how often the adapter root is re-listed for load reports
STALLED = "the engine's step loop is stalled (watchdog); send the request to another engine"
_FINISH = {
    "stop": inference_pb2.STOP,
    "length": inference_pb2.LENGTH,
    "abort": inference_pb2.ABORTED,
}


@dataclass(frozen=True)
class ServerConfig:
    """The worker process around the engine."""

    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 0  # 0: no /metrics endpoint
    drain_seconds: float = 30.0  # SIGTERM: time in-flight streams get to finish
    embed_batching: BatcherConfig = field(default_factory=BatcherConfig)  # the Embed RPC's batcher
    security: ServerSecurity = field(default_factory=ServerSecurity)  # TLS, client certs, token
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # step-time limits

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if not self.drain_seconds >= 0:  # NaN too
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")


def response_proto(out: RequestOutput) -> engine_pb2.EngineGenerateResponse:
    return _fill(engine_pb2.EngineGenerateResponse(), out)


def _fill(msg: engine_pb2.EngineGenerateResponse, out: RequestOutput) -> engine_pb2.EngineGenerateResponse:
    """Writes `out` into `msg` field by field (no keyword dict: this runs for every
    token of every step); returns `msg`."""
    msg.token_ids.extend(out.new_token_ids)
    if out.finished and out.finish_reason:
        msg.finish_reason = _FINISH[out.finish_reason]
    msg.num_prompt_tokens = out.num_prompt_tokens
    msg.num_cached_tokens = out.num_cached_tokens
    msg.num_output_tokens = out.num_output_tokens
    if out.new_logprobs:
        msg.logprobs.extend(
            inference_pb2.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in out.new_logprobs
        )
    return msg


@dataclass(eq=False)
class _Live:
    """One request the engine is serving (through Generate or a session), from its
    admission to its end: the state its metrics and the drain need."""

    request_id: str
    adapter: str
    arrival: float  # time.monotonic()
    session: _Session | None = None  # None: a Generate call
    handle: int = 0  # the session's number for it
    first: float | None = None  # when its first token went out
    tokens: int = 0
    prompt: int = 0
    cached: int = 0
    timer: asyncio.TimerHandle | None = None  # its deadline, on a session


class _Session:
    """One router's Session stream. `deliver` (handed each step's outputs by the step loop,
    run on this server's event loop) adds its requests' outputs to the pending update; the
    stream's writer sends whatever is pending when it can, so steps the router has not read
    yet are merged. A started request's plain token (no logprobs, no finish) costs two list
    appends, sent as the update's packed (handle, token) pairs when the router reads them
    (`packed`); the rest become entries, one per request and update."""

    def __init__(self, service: EngineService, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._service = service
        self.packed = False  # the router said it reads SessionUpdate.tokens
        self.pending = engine_pb2.SessionUpdate()
        # request -> its entry in `pending`: steps the writer has not sent yet (the router
        # reads slower than steps come) are merged into one entry per request
        self._entries: dict[_Live, engine_pb2.EngineGenerateResponse] = {}
        self._handles: list[int] = []  # the pending packed tokens, pair by pair
        self._tokens: list[int] = []
        self.ready = asyncio.Event()  # something is pending, or the router has left
        self.closed = False  # the router's side of the stream has ended

    def deliver(self, items: list[Delivery]) -> None:
        live_requests = self._service._live
        outputs = self.pending.outputs
        for item in items:
            live = live_requests.get(item.request_id)
            if live is None or live.session is not self:
                continue  # ended here already (aborted, deadline): nothing more to say
            if isinstance(item, Refused):
                self.fail(live, *_error_status(item.error))
                continue
            if item.finish_reason == "deadline":  # the scheduler ended it before its first token
                self.fail(live, grpc.StatusCode.DEADLINE_EXCEEDED, item.error or "deadline passed")
                continue
            if item.error is not None:  # the engine ended it: its adapter failed to load
                self.fail(live, *_error_status(AdapterStateError(item.error)))
                continue
            entry = self._entries.get(live)
            if entry is None:
                if (self.packed and live.first is not None and not item.finished
                        and not item.new_logprobs):
                    for token in item.new_token_ids:  # one per step
                        self._handles.append(live.handle)
                        self._tokens.append(token)
                    live.tokens = item.num_output_tokens
                    continue
                entry = self._entries[live] = outputs.add(handle=live.handle)
            _fill(entry, item)  # tokens and logprobs append; counts and finish are the latest
            if item.new_token_ids and live.first is None:
                live.first = time.monotonic()
            live.tokens = item.num_output_tokens
            live.prompt, live.cached = item.num_prompt_tokens, item.num_cached_tokens
            if item.finished:
                self._service._end(live, item.finish_reason or "stop")
        self.ready.set()

    def fail(self, live: _Live, code: grpc.StatusCode, message: str) -> None:
        """Ends `live` with an error the router hears as its status."""
        self.refuse(live.handle, code, message)
        self._service._end(live, code.name.lower())

    def refuse(self, handle: int, code: grpc.StatusCode, message: str) -> None:
        self.pending.outputs.add(handle=handle, status_code=code.value[0], status_message=message)
        self.ready.set()

    def take(self) -> engine_pb2.SessionUpdate | None:
        """The pending update (None when there is nothing to send), and a fresh one."""
        update, self.pending = self.pending, engine_pb2.SessionUpdate()
        self._entries.clear()
        self.ready.clear()
        if self._tokens:
            update.token_handles.extend(self._handles)
            update.tokens.extend(self._tokens)
            self._handles, self._tokens = [], []
        elif not update.outputs:
            return None
        return update


class EngineMetrics:
    """Prometheus metrics of one engine process."""

    def __init__(self, aengine: AsyncEngine) -> None:
        disable_created_metrics()  # the *_created series only add noise to every counter
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnibus_engine_requests",
            "Generate calls that ended, by outcome",
            ["outcome"],
            registry=r,
        )
        self.latency = RequestLatency("omnibus_engine", r)
        self.adapter_requests = Counter(
            "omnibus_engine_adapter_requests",
            "Generate calls the engine accepted for a LoRA adapter, by adapter",
            ["adapter"],
            registry=r,
        )
        tokens = {
            "prompt_tokens": "Prompt tokens of the requests that ended",
            "generation_tokens": "Tokens generated by the requests that ended",
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache (their KV reused)",
        }
        self.tokens = {k: Counter(f"omnibus_engine_{k}", doc, registry=r) for k, doc in tokens.items()}
        r.register(_StatsCollector(aengine))

    def count_tokens(self, prompt: int, cached: int, generated: int) -> None:
        """One request's tokens, when it ends (vLLM's token and prefix-cache counters)."""
        for name, n in (("prompt_tokens", prompt), ("prefix_cache_queries", prompt),
                        ("prefix_cache_hits", cached), ("generation_tokens", generated)):
            self.tokens[name].inc(n)

    def observe(self, arrival: float, first: float | None, tokens: int, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.latency.observe(arrival, first, time.monotonic(), tokens)


class _StatsCollector(Collector):
    """Engine gauges, read from the step loop's latest snapshot at scrape time."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self._aengine = aengine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._aengine.stats()
        gauges = {
            "running_sequences": ("Sequences holding KV blocks", s.num_running),
            "waiting_sequences": ("Sequences waiting to be scheduled", s.num_waiting),
            "kv_blocks_free": (
                "Free KV blocks (evictable prefix-cache blocks included)",
                s.num_free_blocks,
            ),
            "kv_blocks_used": (
                "KV blocks held by sequences",
                s.num_total_blocks - s.num_free_blocks,
            ),
            "kv_blocks_total": ("Usable KV blocks", s.num_total_blocks),
            "kv_blocks_cached": (
                "Free blocks still holding reusable prefix KV",
                s.num_cached_blocks,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"omnibus_engine_{name}", doc, value=value)
        used = (s.num_total_blocks - s.num_free_blocks) / s.num_total_blocks if s.num_total_blocks else 0.0
        yield GaugeMetricFamily(
            "omnibus_engine_kv_cache_usage_ratio", "KV blocks held by sequences / usable (0-1)", value=used
        )
        yield CounterMetricFamily("omnibus_engine_steps", "Engine steps run", value=s.num_steps)
        yield CounterMetricFamily(
            "omnibus_engine_preemptions", "Sequences preempted", value=s.num_preemptions
        )
        config = self._aengine.config
        if config.adapter_dir is not None:
            yield from _adapter_metrics(s, config)


def _adapter_metrics(
    s: EngineStats, config: EngineConfig
) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
    gauges = {
        "adapter_slots": ("Device adapter slots (--max-loras)", config.max_loras),
        "adapters_resident": ("Adapters in device slots", len(s.resident_adapters)),
        "adapters_cached": ("Adapters in host memory (resident ones included)",
                            len(s.cached_adapters)),
        "adapters_running": ("Distinct adapters of the running sequences",
                             s.num_running_adapters),
    }
    for name, (doc, value) in gauges.items():
        yield GaugeMetricFamily(f"omnibus_engine_{name}", doc, value=value)
    yield CounterMetricFamily(
        "omnibus_engine_adapter_loads", "Adapters read from disk into host memory",
        value=s.adapter_loads,
    )
    yield CounterMetricFamily(
        "omnibus_engine_adapter_evictions", "Device slots refilled with another adapter",
        value=s.adapter_evictions,
    )
    # One duration per successful disk load (a copy taken atomically); the histogram is
    # rebuilt from it at scrape time.
    seconds = s.adapter_load_seconds
    buckets = [(str(b), float(sum(1 for x in seconds if x <= b))) for b in ADAPTER_LOAD_BUCKETS]
    buckets.append(("+Inf", float(len(seconds))))
    yield HistogramMetricFamily(
        "omnibus_engine_adapter_load_seconds",
        "Time to read and check an adapter's weights from disk",
        buckets=buckets,
        sum_value=sum(seconds),
    )


class AdapterCatalog:
    """The adapter names under the adapter root, for load reports. Listing a directory
    is blocking I/O (the root may be a network mount), so it runs on a worker thread,
    every CATALOG_REFRESH_S and after each load or unload."""

    def __init__(self, root: str | Path | None) -> None:
        self._root = None if root is None else Path(root)
        self.names: tuple[str, ...] = tuple(list_adapter_names(self._root)) if self._root else ()

    async def refresh(self) -> None:
        if self._root is None:
            return
        try:
            self.names = tuple(await asyncio.to_thread(list_adapter_names, self._root))
        except Exception as exc:  # noqa: BLE001 (keep the last listing and the task; say why it is stale)
            log.warning("adapter_root_unreadable", error=repr(exc))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(CATALOG_REFRESH_S)
            await self.refresh()


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(
        self, aengine: AsyncEngine, metrics: EngineMetrics, catalog: AdapterCatalog | None = None
    ) -> None:
        self._aengine = aengine
        self._metrics = metrics
        self.catalog = catalog or AdapterCatalog(aengine.config.adapter_dir)
        self._live: dict[str, _Live] = {}  # request id -> the request being served
        self._sessions: set[_Session] = set()  # the routers' open Session streams
        self._num_requests = 0
        self.draining = False
        self.stalled = False  # the watchdog saw a step run past its limit

    @property
    def num_active(self) -> int:
        return len(self._live)

    async def Session(
        self, requests: AsyncIterator[engine_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SessionUpdate]:
        session = _Session(self, asyncio.get_running_loop())
        reader = asyncio.create_task(self._read_session(session, requests))
        self._sessions.add(session)
        try:
            while True:
                await session.ready.wait()
                update = session.take()
                if update is not None:
                    yield update
                if session.closed:
                    return
        finally:
            self._sessions.discard(session)
            reader.cancel()
            for live in [x for x in self._live.values() if x.session is session]:
                self._aengine.abort(live.request_id)  # the router is gone: free the KV
                self._end(live, "cancelled")

    async def _read_session(
        self, session: _Session, requests: AsyncIterator[engine_pb2.SessionRequest]
    ) -> None:
        try:
            async for request in requests:
                session.packed = request.packed_tokens
                for add in request.add:
                    self._session_add(session, add)
                for request_id in request.abort:
                    live = self._live.get(request_id)
                    if live is not None and live.session is session:
                        self._aengine.abort(request_id)
                        self._end(live, "cancelled")
        except grpc.aio.AioRpcError:  # the call broke: the writer's finally aborts what is left
            pass
        finally:
            session.closed = True
            session.ready.set()

    def _session_add(self, session: _Session, request: engine_pb2.EngineGenerateRequest) -> None:
        code, message = self._refusal(request)
        if code is not None:
            self._metrics.requests.labels(code.name.lower()).inc()
            session.refuse(request.handle, code, message)
            return
        rid = request.request_id
        live = _Live(rid, request.adapter, time.monotonic(), session, request.handle)
        self._live[rid] = live
        self._num_requests += 1
        deadline = None
        if request.deadline_ms:
            remaining = request.deadline_ms / 1000
            deadline = live.arrival + remaining
            live.timer = session.loop.call_later(remaining, self._expire, live)
        try:
            params = SamplingParams.from_proto(request.sampling)
            self._aengine.add(rid, list(request.prompt_token_ids), params, session,
                              request.priority, request.adapter or None, request.tenant,
                              request.tenant_weight or 1.0, deadline)
        except (ValueError, RuntimeError) as exc:
            session.fail(live, *_error_status(exc))

    def _expire(self, live: _Live) -> None:
        if self._live.get(live.request_id) is live and live.session is not None:
            self._aengine.abort(live.request_id)
            live.session.fail(live, grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the request's deadline passed; it was aborted")

    def _end(self, live: _Live, outcome: str) -> None:
        """`live` has ended (`outcome`: a finish reason, a status code's name, or
        cancelled): out of the registry, into the metrics."""
        if self._live.pop(live.request_id, None) is not live:
            return
        if live.timer is not None:
            live.timer.cancel()
        self._metrics.observe(live.arrival, live.first, live.tokens, outcome)
        self._metrics.count_tokens(live.prompt, live.cached, live.tokens)
        if live.adapter and outcome not in ("invalid_argument", "not_found"):
            self._metrics.adapter_requests.labels(live.adapter).inc()

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        arrival, first, tokens, outcome = time.monotonic(), None, 0, "cancelled"
        prompt = cached = 0
        code, message = self._refusal(request)
        if code is not None:
            self._metrics.requests.labels(code.name.lower()).inc()
            await context.abort(code, message)
            return
        rid = request.request_id
        self._live[rid] = _Live(rid, request.adapter, arrival)
        self._num_requests += 1
        try:
            async for out in self._outputs(request, context):
                first = first or (time.monotonic() if out.new_token_ids else None)
                tokens = out.num_output_tokens
                prompt, cached = out.num_prompt_tokens, out.num_cached_tokens
                if out.finished:
                    outcome = out.finish_reason or "stop"
                yield response_proto(out)
        except (ValueError, UnknownAdapterError, TimeoutError, RuntimeError) as exc:
            code, message = _error_status(exc)
            outcome = code.name.lower()
            await context.abort(code, message)
        finally:
            self._live.pop(rid, None)
            self._metrics.observe(arrival, first, tokens, outcome)
            self._metrics.count_tokens(prompt, cached, tokens)
            if request.adapter and outcome not in ("invalid_argument", "not_found"):
                self._metrics.adapter_requests.labels(request.adapter).inc()

    async def _outputs(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until it finishes, its deadline passes (TimeoutError) or
        the call is cancelled; leaving early aborts the sequence."""
        params = SamplingParams.from_proto(request.sampling)
        remaining = context.time_remaining()
        if request.deadline_ms:
            remaining = min(remaining or math.inf, request.deadline_ms / 1000)
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        # The scheduler's clock is time.monotonic (the loop's clock, but not guaranteed to be).
        scheduler_deadline = None if remaining is None else time.monotonic() + remaining
        # AsyncEngine.generate is an async generator function (it is annotated as an iterator).
        stream = cast(
            AsyncGenerator[RequestOutput, None],
            self._aengine.generate(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.priority,
                request.adapter or None,
                request.tenant,
                request.tenant_weight or 1.0,
                scheduler_deadline,
            ),
        )
        async with aclosing(stream):
            while True:
                # The timeout wraps only the wait for the next step, never the yield.
                async with asyncio.timeout_at(deadline):
                    out = await anext(stream)
                if out.finish_reason == "deadline":  # the scheduler ended it before its first token
                    raise TimeoutError(out.error)
                if out.error is not None:  # the engine ended it: its adapter failed to load
                    raise AdapterStateError(out.error)
                yield out
                if out.finished:
                    return

    async def Embed(
        self, request: engine_pb2.EngineEmbedRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineEmbedResponse:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the engine is shutting down; send the request to another engine")
        if self.stalled:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STALLED)
        if request.pooling not in inference_pb2.Pooling.values():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"pooling must be MEAN (1) or LAST (2), or unset for MEAN; got {request.pooling}")
        pooling = "last" if request.pooling == inference_pb2.LAST else "mean"
        try:
            vectors = await self._aengine.embed(
                [list(x.ids) for x in request.inputs], pooling, request.normalize,
                request.priority, request.queue_timeout_ms or None)
        except (QueueFullError, QueueTimeoutError, ValueError, StepLoopDown) as exc:
            await context.abort(*_error_status(exc))
        return engine_pb2.EngineEmbedResponse(embeddings=[
            inference_pb2.Embedding(values=v, num_tokens=len(x.ids))
            for v, x in zip(vectors, request.inputs)])

    def _refusal(
        self, request: engine_pb2.EngineGenerateRequest
    ) -> tuple[grpc.StatusCode | None, str]:
        if self.draining:
            return (
                grpc.StatusCode.UNAVAILABLE,
                "the engine is shutting down; send the request to another engine",
            )
        if self.stalled:
            return grpc.StatusCode.UNAVAILABLE, STALLED
        if not request.request_id:
            return grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"
        if request.request_id in self._live:
            return (
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {request.request_id!r} is already streaming",
            )
        if self._aengine.error is not None:
            return self._crashed()
        return None, ""

    def _crashed(self) -> tuple[grpc.StatusCode, str]:
        """What a crashed step loop answers: UNAVAILABLE, so routers go elsewhere."""
        return grpc.StatusCode.UNAVAILABLE, f"the engine step loop has crashed: {self._aengine.error!r}"

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = max(
            request.interval_ms / 1000 or DEFAULT_REPORT_INTERVAL_S, MIN_REPORT_INTERVAL_S
        )
        last, last_sent = None, 0.0
        while self._aengine.error is None and not self.stalled:
            stats = self._aengine.stats()
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
        if self._aengine.error is None:  # stalled: routers mark the engine unhealthy
            await context.abort(grpc.StatusCode.UNAVAILABLE, STALLED)
        await context.abort(*self._crashed())

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        stats = self._aengine.stats()
        return engine_pb2.StatsResponse(
            load=self._report(stats),
            num_cached_blocks=stats.num_cached_blocks,
            num_steps=stats.num_steps,
            num_requests=self._num_requests,
            num_active_streams=len(self._live),
            num_preemptions=stats.num_preemptions,
            num_prefix_cache_hit_blocks=stats.num_prefix_cache_hit_blocks,
            slots_stepped=stats.slots_stepped,
            useful_tokens=stats.useful_tokens,
            kv_tokens_stored=stats.kv_tokens_stored,
            kv_tokens_reserved=stats.kv_tokens_reserved,
        )

    # ---- adapters ------------------------------------------------------------

    async def LoadAdapter(
        self, request: engine_pb2.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.LoadAdapterResponse:
        try:
            loaded = await self._aengine.load_adapter(request.adapter)
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
            was_loaded = await self._aengine.unload_adapter(request.adapter)
        except (ValueError, LookupError, RuntimeError) as exc:
            await self._adapter_refusal(context, "unload", request.adapter, exc)
        await self.catalog.refresh()
        log.info("adapter_unloaded", adapter=request.adapter, was_loaded=was_loaded)
        return engine_pb2.UnloadAdapterResponse(adapter=request.adapter, was_loaded=was_loaded)

    async def ListAdapters(
        self, request: engine_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.ListAdaptersResponse:
        try:
            inventory = await self._aengine.list_adapters()
        except RuntimeError as exc:
            await self._adapter_refusal(context, "list", "", exc)
        await self.catalog.refresh()
        config = self._aengine.config
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
        return reply

    async def _adapter_refusal(
        self, context: grpc.aio.ServicerContext, action: str, adapter: str, exc: Exception
    ) -> NoReturn:
        code, message = _error_status(exc)
        log.info("adapter_refused", action=action, adapter=adapter[:140], code=code.name,
                 message=message)
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort raises")

    def load_report(self) -> engine_pb2.LoadReport:
        return self._report(self._aengine.stats())

    def _report(self, stats: EngineStats) -> engine_pb2.LoadReport:
        config = self._aengine.config
        return engine_pb2.LoadReport(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            max_model_len=self._aengine.max_model_len,
            draining=self.draining,
            resident_adapters=sorted(stats.resident_adapters),
            cached_adapters=stats.cached_adapters,
            available_adapters=self.catalog.names,
            prefix_generation=stats.prefix_generation,
            adapter_salts=dict(stats.adapter_salts),
        )

    async def end_sessions(self, wait: float = 0.5) -> None:
        """Ends the routers' Session streams (OK, after what is pending), so the server's
        stop does not cancel their handlers mid-write (gRPC logs those as unhandled
        errors with a traceback); a router reconnects to the next engine."""
        for session in self._sessions:
            session.closed = True
            session.ready.set()
        await _wait_until(lambda: not self._sessions, wait)

    async def drain(self, grace: float) -> None:
        """Refuses new requests, lets in-flight ones finish for `grace` seconds, then
        aborts the rest (their streams end with finish reason ABORTED)."""
        self.draining = True
        if await _wait_until(lambda: not self._live, grace):
            return
        log.warning("drain_grace_expired", aborting=sorted(self._live))
        for rid in list(self._live):
            self._aengine.abort(rid)
        await _wait_until(lambda: not self._live, ABORT_WAIT_S)


def _error_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"embed {exc}"
    if isinstance(exc, QueueTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, f"embed request {exc}"
    if isinstance(exc, UnknownAdapterError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AdapterStateError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, StepLoopDown):  # the engine is gone in all but name: retry elsewhere
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "the request's deadline passed; it was aborted"
    return grpc.StatusCode.INTERNAL, f"engine failure: {exc}"


async def _wait_until(done: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    """Polls `done()` until it is true (True) or `timeout` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(poll)
    return True


@dataclass
class RunningServer:
    """An engine worker's gRPC server, started; `stop()` drains and shuts it down."""

    server: grpc.aio.Server
    service: EngineService
    aengine: AsyncEngine
    health_servicer: health.aio.HealthServicer
    tasks: list[asyncio.Task[None]]

    async def stop(self, drain_seconds: float) -> None:
        await _set_health(self.health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.service.drain(drain_seconds)
        await self.service.end_sessions()
        for task in self.tasks:
            task.cancel()
        await self.server.stop(0.2)  # what is left are load and health watches
        self.aengine.shutdown()


async def start(
    engine: Engine | ProcessCore, config: ServerConfig,
    watchdog_exit: Callable[[str], None] = exit_process,
) -> RunningServer:
    """Starts serving `engine` (already loaded and warmed up; its step loop then runs on a
    thread here) or a ProcessCore (the step loop in its own process) on the running event
    loop. `watchdog_exit` ends the process when a step stays stalled (tests record it)."""
    aengine = AsyncEngine(engine, config.embed_batching)
    aengine.start()
    metrics = EngineMetrics(aengine)
    catalog = AdapterCatalog(aengine.config.adapter_dir)
    service = EngineService(aengine, metrics, catalog)
    health_servicer = health.aio.HealthServicer()
    engine_service = Service(service, engine_pb2_grpc.add_EngineServicer_to_server, SERVICE_NAME)
    if config.metrics_port:  # first: a port in use fails before anything listens
        serve_metrics(metrics.registry, config.metrics_port, Path(aengine.config.model).name)
    server = build_server(config.host, config.port, [engine_service], health_servicer,
                          security=config.security)
    await server.start()
    tasks = [asyncio.create_task(catalog.run(), name="adapter-catalog")]

    async def stalled(stalled: bool) -> None:
        service.stalled = stalled
        if not service.draining:
            status = health_pb2.HealthCheckResponse
            await _set_health(health_servicer, status.NOT_SERVING if stalled else status.SERVING)

    watchdog = Watchdog(aengine.heartbeat, config.watchdog, stalled, watchdog_exit)
    tasks.append(asyncio.create_task(watchdog.run(), name="watchdog"))
    tasks.append(asyncio.create_task(_exit_when_the_step_loop_dies(aengine, health_servicer, watchdog_exit),
                                     name="step-loop-guard"))
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    stats = aengine.stats()
    log.info(
        "engine_serving",
        port=config.port,
        **config.security.describe(),
        model=aengine.config.model,
        step_loop="thread" if isinstance(aengine.core, ThreadCore) else "process",
        kv_blocks=stats.num_total_blocks,
        max_num_seqs=aengine.config.max_num_seqs,
        max_model_len=aengine.max_model_len,
        adapters=len(catalog.names) if aengine.config.adapter_dir else None,
        cached_adapters=list(stats.cached_adapters),
    )
    return RunningServer(server, service, aengine, health_servicer, tasks)


STEP_LOOP_POLL_S = 0.25
LAST_WORDS_S = 1.0  # after a step-loop death, before exiting: the failed streams' errors go out


async def _exit_when_the_step_loop_dies(
    aengine: AsyncEngine, health_servicer: health.aio.HealthServicer, exit: Callable[[str], None],
) -> None:
    """A step loop that died (an exception out of it, or its process killed: OOM, a device
    fault) is not coming back, and a server without one serves nothing: health goes
    NOT_SERVING, and once its requests' errors and the load reports' end have gone out the
    process exits (code 70) so the orchestrator restarts the worker. Cancelled when the
    server stops on purpose."""
    while aengine.error is None and aengine.is_alive:
        await asyncio.sleep(STEP_LOOP_POLL_S)
    error = aengine.error or RuntimeError("the step loop ended")
    message = f"engine step loop died ({error!r}); exiting so the worker is restarted"
    log.critical("engine_step_loop_died", error=repr(error), exit_code=EXIT_CODE, message=message)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.sleep(LAST_WORDS_S)
    exit(message)


async def serve(engine: Engine | ProcessCore, config: ServerConfig) -> None:
    """Serves `engine` (see `start`) until SIGTERM or SIGINT, then drains."""
    stop = stop_on_signal()
    running = await start(engine, config)
    freeze_heap()
    await stop.wait()
    log.info(
        "engine_draining", in_flight=running.service.num_active, grace_seconds=config.drain_seconds
    )
    await running.stop(config.drain_seconds)
    log.info("engine_stopped")


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    await set_health(servicer, (SERVICE_NAME,), status)
