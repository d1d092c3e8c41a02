"""The router's waiting room: requests that no engine has room for yet.

Priority classes first, with aging: a request that has waited `aging_seconds` ranks as
if its priority were one higher, so low priority is delayed but never starved. Within
the highest class present, the policy picks:

- "fifo": the earliest arrival. Because every waiting request ages at the same rate,
  the ranking key `priority - arrival / aging_seconds` is fixed when the request
  enters and one heap keeps the order.
- "vtc" (fair share between tenants): the backlogged tenant with the smallest virtual
  token counter (omnibus.common.fairness) whose best request is in that class, and
  that tenant's best-ranked request. A request's class is
  `priority + floor((now - arrival) / aging_seconds)`, which grows with the rank, so
  each tenant's own heap head is its highest-class request. Picking among some
  tenants only (the dispatcher's fair over-admission) still never takes a request
  below the highest class waiting.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omnibus.common.fairness import VirtualTokenCounters

T = TypeVar("T")

QUEUE_POLICIES = ("fifo", "vtc")


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    priority: int
    cost: int  # tokens, for the queued-tokens cap
    rank: float  # priority - arrival / aging (higher is served first)
    order: int  # arrival order: the tie-break
    tenant: str
    removed: bool = field(default=False)


_Slot = tuple[float, int, _Entry]  # (-rank, order, entry): a heap slot


class RequestQueue(Generic[T]):
    """A priority queue with aging and a per-tenant fair-share policy; O(log n) push,
    O(log n + tenants) pop, O(1) removal (lazy).

    Items are tracked by identity: each object may be queued once. Not thread-safe:
    one asyncio loop owns it.
    """

    def __init__(self, aging_seconds: float, policy: str = "vtc") -> None:
        if aging_seconds < 0:
            raise ValueError(f"aging_seconds must be >= 0, got {aging_seconds}")
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"queue policy must be one of {QUEUE_POLICIES}, got {policy!r}")
        self._aging = aging_seconds
        self.policy = policy
        self.counters = VirtualTokenCounters()
        # fifo: every entry in the "" heap; vtc: one heap per tenant.
        self._heaps: dict[str, list[_Slot]] = {}
        self._backlog: Counter[str] = Counter()  # live entries per tenant
        self._entries: dict[int, _Entry[T]] = {}  # id(item) -> entry, for remove()
        self._order = itertools.count()  # FIFO tie-break
        self._tokens = 0
        self._by_priority: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Sum of the costs of the queued items."""
        return self._tokens

    def count_by_priority(self) -> dict[int, int]:
        """Queued items per priority (priorities with none are left out). Safe to call
        from another thread (the metrics endpoint): list() copies the items atomically."""
        return {p: n for p, n in list(self._by_priority.items()) if n}

    def push(
        self,
        item: T,
        priority: int,
        cost: int,
        arrival: float,
        tenant: str = "",
        lift: bool = True,
    ) -> None:
        """Queues `item`; `arrival` is a monotonic timestamp in seconds. A tenant with
        nothing queued is lifted to the backlogged tenants' smallest counter, unless
        `lift` is False (a request put back in the place it had)."""
        if id(item) in self._entries:
            raise ValueError("item is already queued")
        rank = priority - arrival / self._aging if self._aging else float(priority)
        entry = _Entry(item, priority, cost, rank, next(self._order), tenant)
        if lift and not self._backlog[tenant]:
            self.counters.lift(tenant, [t for t, n in self._backlog.items() if n])
        key = tenant if self.policy == "vtc" else ""
        heapq.heappush(self._heaps.setdefault(key, []), (-rank, entry.order, entry))
        self._entries[id(item)] = entry
        self._backlog[tenant] += 1
        self._tokens += cost
        self._by_priority[priority] += 1

    def charge(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """`tenant` was served `tokens` tokens (prompt on dispatch, output as it streams)."""
        self.counters.charge(tenant, tokens, weight)

    def backlogged(self) -> list[str]:
        """The tenants with something queued."""
        return list(self._backlog)

    def pop(self, now: float | None = None, among: Collection[str] | None = None) -> T:
        """Removes and returns the next item (see the module docstring); with `among`
        (policy "vtc" only), the next of those tenants' items in the highest class
        waiting, so that none of them passes a request of a higher class. Raises
        IndexError when there is none."""
        if among is not None and self.policy != "vtc":
            raise ValueError("only the vtc policy picks among tenants")
        heap = self._next_heap(time.monotonic() if now is None else now, among)
        if heap is None:
            raise IndexError("pop from an empty RequestQueue")
        entry = heapq.heappop(heap)[2]
        self._forget(entry)
        return entry.item

    def remove(self, item: T) -> bool:
        """Takes `item` out wherever it is; False if it was not queued."""
        entry = self._entries.get(id(item))
        if entry is None:
            return False
        entry.removed = True  # its heap slot is skipped when it surfaces
        self._forget(entry)
        heap = self._heaps[entry.tenant if self.policy == "vtc" else ""]
        if len(heap) > 2 * len(self._entries) + 64:
            # Mostly dead slots (a burst of cancels): rebuild rather than let them pile up.
            heap[:] = [slot for slot in heap if not slot[2].removed]
            heapq.heapify(heap)
        return True

    def _next_heap(self, now: float, among: Collection[str] | None = None) -> list[_Slot] | None:
        """The heap whose head is served next (among those of `among`, if given, whose
        head is in the highest class waiting), or None."""
        best: tuple[int, float, float, int] | None = None
        chosen = None
        top: int | None = None  # the highest class waiting, whoever's
        for tenant, heap in self._heaps.items():
            while heap and heap[0][2].removed:
                heapq.heappop(heap)
            if not heap:
                continue
            head = heap[0][2]
            level = self._class(head, now)
            top = level if top is None else max(top, level)
            if among is not None and tenant not in among:
                continue
            # Highest class, then the smallest counter, then the best rank, then arrival.
            key = (-level, self.counters[head.tenant], -head.rank, head.order)
            if best is None or key < best:
                best, chosen = key, heap
        if best is not None and -best[0] != top:  # those tenants' best waits behind others'
            return None
        return chosen

    def _class(self, entry: _Entry[T], now: float) -> int:
        if not self._aging:
            return entry.priority
        # priority + floor(waited / aging), from the rank (arrival = (priority - rank) * aging).
        return math.floor(entry.rank + now / self._aging + 1e-9)

    def _forget(self, entry: _Entry[T]) -> None:
        del self._entries[id(entry.item)]
        self._tokens -= entry.cost
        self._by_priority[entry.priority] -= 1
        self._backlog[entry.tenant] -= 1
        if not self._backlog[entry.tenant]:
            del self._backlog[entry.tenant]
            self.counters.left(entry.tenant)
