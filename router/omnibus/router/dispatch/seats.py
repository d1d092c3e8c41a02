"""This router's seats on one engine: the requests it has in flight there (in all, per
tenant, per adapter), how many it keeps there at once, and the room left. The router
counts its own requests because reports lag behind its dispatches."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.adapters import Affinity
from omnibus.router.dispatch.link import EngineLink
from omnibus.router.dispatch.load import LoadView


class Seats:
    """The capacity policy on one engine (from its `load` and whether its `link` is up)
    and the requests this router has seated there."""

    def __init__(
        self, config: RouterConfig, load: LoadView, link: EngineLink, on_change: Callable[[], None]
    ) -> None:
        self._config = config
        self._load = load
        self._link = link
        self._on_change = on_change  # called whenever room may have appeared or gone
        self.retiring = False  # gone from discovery: finishes its requests, takes no new ones
        self._idle = asyncio.Event()  # set while retiring with nothing in flight
        self.inflight = 0  # requests this router has dispatched here and not finished
        self._adapter_inflight: Counter[str] = Counter()  # the same, per adapter
        self.tenant_inflight: Counter[str] = Counter()  # the same, per tenant

    @property
    def capacity(self) -> int:
        """Most requests this router keeps on the engine at once."""
        if self._config.max_inflight_per_engine:
            return self._config.max_inflight_per_engine
        report = self._load.report
        if not report:
            return 0
        # An eighth beyond the engine's running cap waits in its priority-ordered queue, so
        # a slot a finished request frees is refilled at the next step, not a round trip later.
        return report.max_num_seqs + report.max_num_seqs // 8

    @property
    def occupied(self) -> int:
        """Sequences on the engine: its own count, or ours when the report lags behind."""
        report = self._load.report
        reported = report.num_running + report.num_waiting if report else 0
        return max(reported, self.inflight)

    @property
    def accepting(self) -> bool:
        """Reporting load, not draining, not retiring: the engine takes new requests."""
        report = self._load.report
        return (
            self._link.healthy
            and not self.retiring
            and report is not None
            and not report.draining
        )

    def room(self) -> int:
        """How many more requests the engine should get now (0 unless accepting)."""
        return max(0, self.capacity - self.occupied) if self.accepting else 0

    def overflow_room(self) -> int:
        """Room past `capacity` for a tenant under its fair share while another is over
        it (the dispatcher's over-admission), up to twice the capacity."""
        return max(0, 2 * self.capacity - self.occupied) if self.accepting else 0

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

    async def retire(self) -> None:
        """Takes no new requests and returns once the ones in flight have ended (each
        ends by itself: it finishes, hits its deadline, or the engine's drain ends it)."""
        self.retiring = True
        self._on_change()
        if self.inflight:
            self._idle.clear()
            await self._idle.wait()

    def affinity(self, adapter: str) -> Affinity:
        """How ready the engine is to run a request for `adapter` (see router/omnibus/router/dispatch/adapters.py)."""
        if adapter in self._load.adapters_resident or self._adapter_inflight[adapter]:
            return Affinity.RESIDENT
        if adapter in self._load.adapters_cached:
            return Affinity.CACHED
        return Affinity.COLD
