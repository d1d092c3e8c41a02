"""The engine workers as one router sees them.

Each `EngineClient` keeps a WatchLoad stream open to its engine, and one Session stream
(router/omnibus/router/dispatch/session.py) that carries every request this router runs there. Reports say where
there is room; the stream breaking (or going silent) marks the engine unhealthy, and
it is retried with exponential backoff. The router also counts the requests it has in
flight on each engine itself, because reports lag behind its own dispatches.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncGenerator, Callable

import grpc
import structlog
from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.common.fatal import exit_if_it_fails
from omnibus.common.sampling import kv_tokens
from omnibus.router.dispatch.adapters import Affinity
from omnibus.router.dispatch.session import EngineOutput, EngineSession
from omnibus.router.config import RouterConfig

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


class EngineClient:
    """One engine: its channel, its latest load report, and this router's requests on it."""

    def __init__(
        self,
        address: str,
        config: RouterConfig,
        on_change: Callable[[], None],
        on_failure: Callable[[], None] | None = None,
        stub: engine_pb2_grpc.EngineStub | None = None,
    ) -> None:
        """`stub`: the engine's RPCs (default: over a channel to `address`, as configured;
        tests hand in a fake one)."""
        self.address = address
        self._config = config
        self._on_change = on_change  # called whenever room may have appeared or gone
        self._on_failure = on_failure  # called when the engine stops answering
        self.retiring = False  # gone from discovery: finishes its requests, takes no new ones
        self._idle = asyncio.Event()  # set while retiring with nothing in flight
        # TLS / mutual TLS and the engine token, as configured (omnibus.common.security).
        self._channel = config.engine_security().aio_channel(address, _channel_options(config))
        self._stub = stub or engine_pb2_grpc.EngineStub(self._channel)
        self._report: engine_pb2.LoadReport | None = None  # the latest (None: none yet)
        self.healthy = False
        self._unhealthy_reason: str | None = None  # the last one logged, while unhealthy
        self.inflight = 0  # requests this router has dispatched here and not finished
        self._adapter_inflight: Counter[str] = Counter()  # the same, per adapter
        self.tenant_inflight: Counter[str] = Counter()  # the same, per tenant
        # From the latest report: adapters in device slots, in host memory, on disk.
        self.adapters_resident: frozenset[str] = frozenset()
        self.adapters_cached: frozenset[str] = frozenset()
        self.adapters_available: frozenset[str] = frozenset()
        # Keys of the engine's cached prefix blocks (omnibus.common.prefix), for
        # prefix-aware routing; reports carry them only when they change.
        self.prefix_keys: frozenset[int] = frozenset()
        self._prefix_generation: int | None = None
        # Adapter -> the salt the engine hashes its requests' prefix blocks with.
        self.adapter_salts: dict[str, str] = {}
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

    # ---- the latest load report ------------------------------------------------

    @property
    def reported(self) -> bool:
        """The engine has reported since this router started (its figures below are known)."""
        return self._report is not None

    @property
    def max_model_len(self) -> int:
        """The context the engine serves (0: not reported)."""
        return self._report.max_model_len if self._report is not None else 0

    @property
    def block_size(self) -> int:
        """Tokens per KV block (0: not reported)."""
        return self._report.block_size if self._report is not None else 0

    @property
    def running(self) -> int:
        """Sequences running, as last reported."""
        return self._report.num_running if self._report is not None else 0

    @property
    def waiting(self) -> int:
        """Sequences waiting inside the engine, as last reported."""
        return self._report.num_waiting if self._report is not None else 0

    @property
    def free_blocks(self) -> int:
        """Free KV blocks, as last reported."""
        return self._report.num_free_blocks if self._report is not None else 0

    @property
    def total_blocks(self) -> int:
        """Usable KV blocks, as last reported."""
        return self._report.num_total_blocks if self._report is not None else 0

    # ---- capacity ------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Most requests this router keeps on the engine at once."""
        if self._config.max_inflight_per_engine:
            return self._config.max_inflight_per_engine
        if not self._report:
            return 0
        # An eighth beyond the engine's running cap waits in its priority-ordered queue, so
        # a slot a finished request frees is refilled at the next step, not a round trip later.
        return self._report.max_num_seqs + self._report.max_num_seqs // 8

    @property
    def load(self) -> int:
        """Sequences on the engine: its own count, or ours when the report lags behind."""
        reported = self._report.num_running + self._report.num_waiting if self._report else 0
        return max(reported, self.inflight)

    @property
    def accepting(self) -> bool:
        """Reporting load, not draining, not retiring: the engine takes new requests."""
        return (
            self.healthy
            and not self.retiring
            and self._report is not None
            and not self._report.draining
        )

    def room(self) -> int:
        """How many more requests the engine should get now (0 unless accepting)."""
        return max(0, self.capacity - self.load) if self.accepting else 0

    def overflow_room(self) -> int:
        """Room past `capacity` for a tenant under its fair share while another is over
        it (the dispatcher's over-admission), up to twice the capacity."""
        return max(0, 2 * self.capacity - self.load) if self.accepting else 0

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + max_tokens) one request may span on the engine, as it
        last reported: its context, and what its KV pool holds (kv_tokens, the engine's own
        rule). None: no report yet."""
        report = self._report
        if report is None:
            return None
        limits = []
        if report.max_model_len > 0:
            limits.append(report.max_model_len)
        if report.block_size > 0:
            limits.append(kv_tokens(report.num_total_blocks, report.block_size))
        return min(limits, default=None)

    def fits(self, tokens: int) -> bool:
        """A request of `tokens` (prompt + max_tokens) fits the engine's context and KV
        pool, as far as the router knows (one that has not reported counts as fitting)."""
        most = self.max_request_tokens()
        return most is None or tokens <= most

    def free_block_share(self) -> float:
        report = self._report
        return (
            report.num_free_blocks / report.num_total_blocks
            if report and report.num_total_blocks
            else 0.0
        )

    def acquire(self, adapter: str = "", tenant: str = "") -> None:
        """Counts a request dispatched here (`adapter`: its LoRA adapter, "" for none;
        `tenant`: whose it is)."""
        self.inflight += 1
        self.tenant_inflight[tenant] += 1
        if adapter:
            self._adapter_inflight[adapter] += 1

    def release(self, adapter: str = "", tenant: str = "") -> None:
        """The request `acquire` counted has ended."""
        self.inflight -= 1
        self.tenant_inflight[tenant] -= 1
        if not self.tenant_inflight[tenant]:
            del self.tenant_inflight[tenant]
        if adapter:
            self._adapter_inflight[adapter] -= 1
            if not self._adapter_inflight[adapter]:
                del self._adapter_inflight[adapter]
        if self.retiring and not self.inflight:
            self._idle.set()
        self._on_change()

    # ---- adapters ------------------------------------------------------------

    def has_adapter(self, adapter: str) -> bool:
        """The engine can serve `adapter`: it is under the engine's adapter root."""
        return adapter in self.adapters_available

    def affinity(self, adapter: str) -> Affinity:
        """How ready the engine is to run a request for `adapter` (see router/omnibus/router/dispatch/adapters.py)."""
        if adapter in self.adapters_resident or self._adapter_inflight[adapter]:
            return Affinity.RESIDENT
        if adapter in self.adapters_cached:
            return Affinity.CACHED
        return Affinity.COLD

    def mark_failed(self, reason: str) -> None:
        """A call found the engine gone: stop sending it work until it reports again."""
        if self.healthy:
            self._set_healthy(False, reason)

    # ---- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._task = exit_if_it_fails(asyncio.create_task(self._watch(), name=f"watch-{self.address}"))

    async def retire(self) -> None:
        """Takes no new requests and returns once the ones in flight have ended (each
        ends by itself: it finishes, hits its deadline, or the engine's drain ends it)."""
        self.retiring = True
        self._on_change()
        if self.inflight:
            self._idle.clear()
            await self._idle.wait()

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
        self._prefix_generation = None  # a new stream's first report carries the keys
        try:
            while True:
                async with asyncio.timeout(self._config.engine_stale_seconds):
                    report = await call.read()
                if report is grpc.aio.EOF:
                    return "the engine closed its load stream"
                self.take_report(report)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except TimeoutError:
            return f"no load report for {self._config.engine_stale_seconds} s"
        finally:
            call.cancel()

    def take_report(self, report: engine_pb2.LoadReport) -> None:
        """The engine's latest load report (its WatchLoad stream's; tests hand one in):
        the engine is healthy and its figures are these."""
        self._report = report
        self.adapters_resident = frozenset(report.resident_adapters)
        self.adapters_cached = frozenset(report.cached_adapters)
        self.adapters_available = frozenset(report.available_adapters)
        if report.prefix_generation != self._prefix_generation:
            self.prefix_keys = frozenset(report.prefix_block_keys)
            self._prefix_generation = report.prefix_generation
        if report.adapter_salts != self.adapter_salts:
            self.adapter_salts = dict(report.adapter_salts)
        self._retry_delay = self._config.engine_retry_initial_seconds
        self._set_healthy(True, "load report received")

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

