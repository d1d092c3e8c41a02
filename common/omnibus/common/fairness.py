"""Virtual token counters (VTC, "Fairness in Serving Large Language Models", OSDI
2024): one definition for the router's queue and the engine's scheduler.

Each tenant's counter grows by the tokens it is served (prompt and output) divided by
its weight; whoever picks the next request takes it from the backlogged tenant with
the smallest counter. A tenant that becomes backlogged after idling is lifted to the
smallest counter among the backlogged tenants (to the counter of the last tenant
that left the backlog when there is none), so idling banks no credit.
"""

from __future__ import annotations

from collections.abc import Iterable


class VirtualTokenCounters:
    """Counters per tenant. Not thread-safe: one owner (an asyncio loop, the step thread)."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._last_left = 0.0  # counter of the last tenant whose backlog emptied

    def __getitem__(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter (for metrics and tests)."""
        return dict(self._counters)

    def charge(self, tenant: str, tokens: float, weight: float = 1.0) -> None:
        """`tenant` was served `tokens` tokens; `weight` > 0 is its share (2.0: twice)."""
        self._counters[tenant] = self[tenant] + tokens / weight

    def lift(self, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` becomes backlogged; `backlogged` are the tenants that already are."""
        floor = min((self[t] for t in backlogged if t != tenant), default=self._last_left)
        self._counters[tenant] = max(self[tenant], floor)

    def left(self, tenant: str) -> None:
        """`tenant`'s backlog emptied."""
        self._last_left = self[tenant]
