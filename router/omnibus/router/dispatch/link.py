"""One engine's link: its channel and RPCs, the WatchLoad stream that says it is up,
and the backoff between tries when it is not.

The link keeps a WatchLoad stream open and hands each report on; the stream breaking
(or going silent) marks the engine unhealthy, and it is retried with exponential
backoff. Every request this router runs there goes over one Session stream
(router/omnibus/router/dispatch/session.py), opened by the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import grpc
import structlog
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.common.fatal import exit_if_it_fails
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.session import EngineOutput, EngineSession

log = structlog.get_logger("router.engines")

# Keepalive pings find a dead peer the OS does not report (a cut cable, a frozen host).
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 16 << 20),
    # A fixed 64 KB receive window (HTTP/2's default; BDP probing would grow it to MBs):
    # when this router falls behind an engine's Session updates, the engine's writes
    # block after a few steps and it merges the steps not yet sent into one update, so
    # the router handles fewer, larger outputs instead of a growing backlog of one-token
    # updates (host.md: ~1.5 -> ~3 tokens per client message at 256 streams).
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 64 << 10),
]


def _channel_options(config: RouterConfig) -> list[tuple[str, int]]:
    # The channel's own reconnect backoff (up to 120 s by default) would otherwise
    # delay our WatchLoad retries long after the engine is back.
    backoff_ms = {
        "grpc.initial_reconnect_backoff_ms": int(config.engine_retry_initial_seconds * 1000),
        "grpc.min_reconnect_backoff_ms": int(config.engine_retry_initial_seconds * 1000),
        "grpc.max_reconnect_backoff_ms": int(config.engine_retry_max_seconds * 1000),
    }
    return CHANNEL_OPTIONS + list(backoff_ms.items())


class EngineLink:
    """One engine's channel, its calls, and whether its load reports arrive (`healthy`)."""

    def __init__(
        self,
        address: str,
        config: RouterConfig,
        on_report: Callable[[engine_pb2.LoadReport], None],
        on_stream: Callable[[], None],
        on_change: Callable[[], None],
        on_failure: Callable[[], None] | None = None,
        stub: engine_pb2_grpc.EngineStub | None = None,
    ) -> None:
        """`on_report`: gets each report the WatchLoad stream reads; `on_stream`: called as
        a new WatchLoad stream opens; `stub`: the engine's RPCs (default: over a channel to
        `address`, as configured; tests hand in a fake one)."""
        self.address = address
        self._config = config
        self._on_report = on_report
        self._on_stream = on_stream
        self._on_change = on_change  # called whenever room may have appeared or gone
        self._on_failure = on_failure  # called when the engine stops answering
        # TLS / mutual TLS and the engine token, as configured (omnibus.common.security).
        self._channel = config.engine_security().aio_channel(address, _channel_options(config))
        self._stub = stub or engine_pb2_grpc.EngineStub(self._channel)
        self.healthy = False
        self._unhealthy_reason: str | None = None  # the last one logged, while unhealthy
        self._retry_delay = config.engine_retry_initial_seconds
        self._task: asyncio.Task[None] | None = None
        self._session: EngineSession | None = None  # opened by the first request

    # ---- requests ------------------------------------------------------------

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, timeout: float | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Runs `request` on the engine and yields its outputs, the last with finish_reason
        set; outputs the caller has not read yet are merged into one. `timeout`: seconds
        left of the client's deadline. Raises grpc.aio.AioRpcError as a Generate call
        would. Closing the generator early aborts the request (its KV freed in a step)."""
        if self._session is None or self._session.closed:
            self._session = EngineSession(self._stub, self.address)
        return self._session.generate(request, timeout, self._config.stream_interval)

    def release(self, request_id: str) -> None:
        """The engine may give back the KV an ended request holds for a transfer."""
        if self._session is not None:
            self._session.release(request_id)

    async def embed(
        self, request: engine_pb2.EngineEmbedRequest, timeout: float | None = None
    ) -> engine_pb2.EngineEmbedResponse:
        """The engine's embeddings of `request`'s inputs. Raises grpc.aio.AioRpcError."""
        return await self._stub.Embed(request, timeout=timeout)

    # ---- adapters on the engine (the admin API) --------------------------------

    async def load_adapter(self, adapter: str, timeout: float) -> engine_pb2.LoadAdapterResponse:
        """Loads `adapter` into the engine's memory. Raises grpc.aio.AioRpcError."""
        return await self._stub.LoadAdapter(engine_pb2.LoadAdapterRequest(adapter=adapter),
                                            timeout=timeout)

    async def unload_adapter(self, adapter: str, timeout: float) -> engine_pb2.UnloadAdapterResponse:
        """Drops `adapter` from the engine's memory. Raises grpc.aio.AioRpcError."""
        return await self._stub.UnloadAdapter(engine_pb2.UnloadAdapterRequest(adapter=adapter),
                                              timeout=timeout)

    async def list_adapters(self, timeout: float) -> engine_pb2.ListAdaptersResponse:
        """The engine's own listing (resident, cached, on disk). Raises grpc.aio.AioRpcError."""
        return await self._stub.ListAdapters(engine_pb2.ListAdaptersRequest(), timeout=timeout)

    # ---- health --------------------------------------------------------------

    def mark_failed(self, reason: str) -> None:
        """A call found the engine gone: stop sending it work until it reports again."""
        if self.healthy:
            self._set_healthy(False, reason)

    def heard(self) -> None:
        """A load report arrived: the engine is healthy, and the next failure's retry
        starts at the first delay again."""
        self._retry_delay = self._config.engine_retry_initial_seconds
        self._set_healthy(True, "load report received")

    # ---- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._task = exit_if_it_fails(asyncio.create_task(self._watch(), name=f"watch-{self.address}"))

    async def close(self, grace: float | None = None) -> None:
        """Stops watching; calls still open get `grace` seconds (None: cancelled now)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:  # retired engines close with nothing in flight
            await self._session.close()
        await self._channel.close(grace)

    async def _watch(self) -> None:
        while True:
            reason = await self._follow_reports()
            self._set_healthy(False, reason)
            await self._pause()
            self._retry_delay = min(self._retry_delay * 2, self._config.engine_retry_max_seconds)

    async def _pause(self) -> None:
        """Until the next try: the retry delay, or, while the channel is not connected,
        until it connects (its own backoff paces those attempts) if that comes first.
        The two waits used to add up: a restarted engine was taken back up to ~2 s after
        its channel was ready."""
        if self._channel.get_state() == grpc.ChannelConnectivity.READY:
            await asyncio.sleep(self._retry_delay)  # it answered, and failed: back off
            return
        try:
            async with asyncio.timeout(self._retry_delay):
                await self._channel.channel_ready()
        except TimeoutError:
            pass

    async def _follow_reports(self) -> str:
        """Reads load reports until the stream fails; returns why it did."""
        call = self._stub.WatchLoad(
            engine_pb2.WatchLoadRequest(interval_ms=self._config.engine_report_interval_ms)
        )
        self._on_stream()  # a new stream's first report carries the keys
        try:
            while True:
                async with asyncio.timeout(self._config.engine_stale_seconds):
                    report = await call.read()
                if report is grpc.aio.EOF:
                    return "the engine closed its load stream"
                self._on_report(report)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except TimeoutError:
            return f"no load report for {self._config.engine_stale_seconds} s"
        finally:
            call.cancel()

    def _set_healthy(self, healthy: bool, reason: str) -> None:
        if healthy:
            if not self.healthy:
                log.info("engine_healthy", engine=self.address, reason=reason)
            self._unhealthy_reason = None
        else:
            # Each new reason once: an engine starts down, so one that never comes up (a
            # wrong token, a refused certificate) says why at its first try, not at every retry.
            if reason != self._unhealthy_reason:
                log.warning("engine_unhealthy", engine=self.address, reason=reason)
            self._unhealthy_reason = reason
            if self.healthy and self._on_failure is not None:
                self._on_failure()
        self.healthy = healthy
        self._on_change()
