"""The engine worker's gRPC server: `omnibus.v1.Engine` over an `AsyncEngine`.

The step loop runs on its own thread (AsyncEngine); this asyncio server only moves
requests in and tokens out, so it never blocks on a step. A request's deadline is the
gRPC deadline the router passes on: when it passes the sequence is aborted and its KV
blocks are freed. SIGTERM drains: health goes NOT_SERVING, new requests get
UNAVAILABLE, in-flight streams get `drain_seconds` to finish and are aborted after.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from omnibus.v1 import engine_pb2, engine_pb2_grpc, inference_pb2
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.async_engine import AsyncEngine
from engine.engine import Engine, EngineStats, UnknownAdapterError
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

log = structlog.get_logger("engine.server")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
DEFAULT_REPORT_INTERVAL_S = 0.05
MIN_REPORT_INTERVAL_S = 0.01
HEARTBEAT_S = 1.0  # a report at least this often, changed or not: routers treat silence as death
ABORT_WAIT_S = 2.0  # after the drain grace, how long aborted streams get to report ABORTED
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
UNSET = inference_pb2.FINISH_REASON_UNSPECIFIED  # still streaming
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

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if self.drain_seconds < 0:
            raise ValueError(f"drain_seconds must be >= 0, got {self.drain_seconds}")


def sampling_params(p: engine_pb2.EngineSamplingParams) -> SamplingParams:
    """The engine's SamplingParams for a request's; ValueError names a bad field."""
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logprobs=p.logprobs,
    )


def response_proto(out: RequestOutput) -> engine_pb2.EngineGenerateResponse:
    logprobs = [
        inference_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in out.new_logprobs
    ]
    return engine_pb2.EngineGenerateResponse(
        token_ids=out.new_token_ids,
        logprobs=logprobs,
        finish_reason=_FINISH[out.finish_reason] if out.finished and out.finish_reason else UNSET,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens,
    )


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
        self.ttft = Histogram(
            "omnibus_engine_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "omnibus_engine_time_per_output_token_seconds",
            "Mean gap between tokens after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "omnibus_engine_e2e_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_StatsCollector(aengine))

    def observe(self, arrival: float, first: float | None, tokens: int, outcome: str) -> None:
        now = time.monotonic()
        self.requests.labels(outcome).inc()
        if first is None:
            return
        self.ttft.observe(first - arrival)
        self.e2e.observe(now - arrival)
        if tokens > 1:
            self.tpot.observe((now - first) / (tokens - 1))


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
        yield CounterMetricFamily("omnibus_engine_steps", "Engine steps run", value=s.num_steps)
        yield CounterMetricFamily(
            "omnibus_engine_preemptions", "Sequences preempted", value=s.num_preemptions
        )


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, aengine: AsyncEngine, metrics: EngineMetrics) -> None:
        self._aengine = aengine
        self._metrics = metrics
        self._active: set[str] = set()  # request ids streaming now
        self._num_requests = 0
        self.draining = False

    @property
    def num_active(self) -> int:
        return len(self._active)

    async def Generate(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        arrival, first, tokens, outcome = time.monotonic(), None, 0, "cancelled"
        code, message = self._refusal(request)
        if code is not None:
            self._metrics.requests.labels(code.name.lower()).inc()
            await context.abort(code, message)
            return
        rid = request.request_id
        self._active.add(rid)
        self._num_requests += 1
        try:
            async for out in self._outputs(request, context):
                first = first or (time.monotonic() if out.new_token_ids else None)
                tokens = out.num_output_tokens
                if out.finished:
                    outcome = out.finish_reason or "stop"
                yield response_proto(out)
        except (ValueError, UnknownAdapterError, TimeoutError, RuntimeError) as exc:
            code, message = _error_status(exc)
            outcome = code.name.lower()
            await context.abort(code, message)
        finally:
            self._active.discard(rid)
            self._metrics.observe(arrival, first, tokens, outcome)

    async def _outputs(
        self, request: engine_pb2.EngineGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs until it finishes, its deadline passes (TimeoutError) or
        the call is cancelled; leaving early aborts the sequence."""
        params = sampling_params(request.sampling)
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        # AsyncEngine.generate is an async generator function (it is annotated as an iterator).
        stream = cast(
            AsyncGenerator[RequestOutput, None],
            self._aengine.generate(
                request.request_id,
                list(request.prompt_token_ids),
                params,
                request.priority,
                request.adapter or None,
            ),
        )
        async with aclosing(stream):
            while True:
                # The timeout wraps only the wait for the next step, never the yield.
                async with asyncio.timeout_at(deadline):
                    out = await anext(stream)
                yield out
                if out.finished:
                    return

    def _refusal(
        self, request: engine_pb2.EngineGenerateRequest
    ) -> tuple[grpc.StatusCode | None, str]:
        if self.draining:
            return (
                grpc.StatusCode.UNAVAILABLE,
                "the engine is shutting down; send the request to another engine",
            )
        if not request.request_id:
            return grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty"
        if request.request_id in self._active:
            return (
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {request.request_id!r} is already streaming",
            )
        if self._aengine.error is not None:
            return (
                grpc.StatusCode.INTERNAL,
                f"the engine step loop has crashed: {self._aengine.error!r}",
            )
        return None, ""

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.LoadReport]:
        interval = max(
            request.interval_ms / 1000 or DEFAULT_REPORT_INTERVAL_S, MIN_REPORT_INTERVAL_S
        )
        last, last_sent = None, 0.0
        while self._aengine.error is None:
            report = self.load_report()
            now = time.monotonic()
            if report != last or now - last_sent >= HEARTBEAT_S:
                yield report
                last, last_sent = report, now
            await asyncio.sleep(interval)
        await context.abort(
            grpc.StatusCode.INTERNAL, f"the engine step loop has crashed: {self._aengine.error!r}"
        )

    async def Stats(
        self, request: engine_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.StatsResponse:
        stats = self._aengine.stats()
        return engine_pb2.StatsResponse(
            load=self._report(stats),
            num_cached_blocks=stats.num_cached_blocks,
            num_steps=stats.num_steps,
            num_requests=self._num_requests,
            num_active_streams=len(self._active),
            num_preemptions=stats.num_preemptions,
            num_prefix_cache_hit_blocks=stats.num_prefix_cache_hit_blocks,
            slots_stepped=stats.slots_stepped,
            useful_tokens=stats.useful_tokens,
            kv_tokens_stored=stats.kv_tokens_stored,
            kv_tokens_reserved=stats.kv_tokens_reserved,
        )

    def load_report(self) -> engine_pb2.LoadReport:
        return self._report(self._aengine.stats())

    def _report(self, stats: EngineStats) -> engine_pb2.LoadReport:
        engine = self._aengine.engine
        return engine_pb2.LoadReport(
            num_waiting=stats.num_waiting,
            num_running=stats.num_running,
            num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks,
            max_num_seqs=engine.config.max_num_seqs,
            block_size=engine.config.block_size,
            max_model_len=engine.model_config.max_model_len,
            draining=self.draining,
        )

    async def drain(self, grace: float) -> None:
        """Refuses new requests, lets in-flight ones finish for `grace` seconds, then
        aborts the rest (their streams end with finish reason ABORTED)."""
        self.draining = True
        if await _wait_until(lambda: not self._active, grace):
            return
        log.warning("drain_grace_expired", aborting=sorted(self._active))
        for rid in list(self._active):
            self._aengine.abort(rid)
        await _wait_until(lambda: not self._active, ABORT_WAIT_S)


def _error_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, UnknownAdapterError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed; it was aborted"
    return grpc.StatusCode.INTERNAL, f"engine failure: {exc}"


async def _wait_until(done: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    """Polls `done()` until it is true (True) or `timeout` seconds pass (False)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(poll)
    return True


def warm_up(engine: Engine) -> None:
    """One prefill and one decode step before serving, so the first request does not pay
    for lazy initialization (allocator, kernels, CUDA context)."""
    token = engine.model_config.bos_token_id or 0
    engine.add_request(
        "warm-up", [token] * 4, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    while engine.has_unfinished():
        engine.step()


async def serve(engine: Engine, config: ServerConfig) -> None:
    """Serves `engine` (already loaded and warmed up) until SIGTERM or SIGINT, then drains."""
    aengine = AsyncEngine(engine)
    aengine.start()
    metrics = EngineMetrics(aengine)
    service = EngineService(aengine, metrics)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        SERVICE_NAME,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{config.host}:{config.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    if config.metrics_port:
        start_http_server(config.metrics_port, registry=metrics.registry)
    stats = aengine.stats()
    log.info(
        "engine_serving",
        port=config.port,
        model=engine.config.model,
        kv_blocks=stats.num_total_blocks,
        max_num_seqs=engine.config.max_num_seqs,
        max_model_len=engine.model_config.max_model_len,
    )
    await _wait_for_signal()
    log.info("engine_draining", in_flight=service.num_active, grace_seconds=config.drain_seconds)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await service.drain(config.drain_seconds)
    await server.stop(0.2)  # what is left are load and health watches
    aengine.shutdown()
    log.info("engine_stopped")


async def _set_health(servicer: health.aio.HealthServicer, status: int) -> None:
    for service in ("", SERVICE_NAME):
        await servicer.set(service, status)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
