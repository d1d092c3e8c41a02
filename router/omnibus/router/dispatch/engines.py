"""The engine workers as one router sees them.

Each `EngineClient` is one engine in three parts: its `link` (the channel and RPCs, the
WatchLoad stream, health and reconnect backoff: router/omnibus/router/dispatch/link.py),
its `load` (the latest LoadReport: load.py) and this router's `seats` on it (capacity,
room, the requests in flight: seats.py).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from omnibus.v1 import engine_pb2, engine_pb2_grpc

from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.link import EngineLink
from omnibus.router.dispatch.load import LoadView
from omnibus.router.dispatch.seats import Seats
from omnibus.router.dispatch.session import EngineOutput


class EngineClient:
    """One engine: its link, its latest load report, and this router's requests on it."""

    def __init__(
        self,
        address: str,
        config: RouterConfig,
        on_change: Callable[[], None],
        on_failure: Callable[[], None] | None = None,
        stub: engine_pb2_grpc.EngineStub | None = None,
    ) -> None:
        """`on_change`: called whenever room may have appeared or gone; `on_failure`: when
        the engine stops answering; `stub`: the engine's RPCs (default: over a channel to
        `address`, as configured; tests hand in a fake one)."""
        self.address = address
        self.load = LoadView()
        self.link = EngineLink(address, config, self.take_report, self.load.new_stream,
                               on_change, on_failure, stub)
        self.seats = Seats(config, self.load, self.link, on_change)

    def generate(
        self, request: engine_pb2.EngineGenerateRequest, timeout: float | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Runs `request` on the engine (EngineLink.generate)."""
        return self.link.generate(request, timeout)

    def release(self, request_id: str) -> None:
        """The engine's KV held for `request_id` (a prefill's, a drained request's) has been
        read, or is no longer wanted (EngineLink.release)."""
        self.link.release(request_id)

    def take_report(self, report: engine_pb2.LoadReport) -> None:
        """The engine's latest load report (its WatchLoad stream's; tests hand one in):
        the engine is healthy and its figures are these."""
        self.load.take(report)
        self.link.heard()

    def start(self) -> None:
        self.link.start()

    async def close(self, grace: float | None = None) -> None:
        """Stops watching; calls still open get `grace` seconds (None: cancelled now)."""
        await self.link.close(grace)
