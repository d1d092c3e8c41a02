"""The scheduler's waiting queue and its choice of preemption victim, under one order.

- "fifo": higher priority first, then earlier arrival; the victim is the lowest
  priority, latest arrival.
- "slo" (the default): within a priority, requests with a deadline first, earliest
  deadline first (EDF); then the tenant with the smallest virtual token counter
  (omnibus.common.fairness, the rule the router's queue follows), then arrival. The
  victim is the lowest priority, then the most slack (time to its deadline; none is
  infinite), then the most-served tenant, then the latest arrival. A waiting request
  may also preempt an equal-priority request of another tenant when
  - that tenant's counter exceeds its own tenant's by more than `fair_preemption_tokens`, or
  - (seat share) its tenant, served no more than the other, holds fewer than its weighted
    share of the seats (`seats` x weight / the active tenants' weights) and still will
    not hold more after taking one, while the other holds more than its share and still
    will not hold less after giving one up; so a light tenant gets a seat at the next
    step instead of when a heavy one finishes, and two tenants never trade a seat back.
  Among tenants with equal counters, the one holding fewer seats per weight goes first.

Entries of requests that left the queue otherwise (aborted, finished) are skipped
lazily, as the scheduler's heap always did.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from omnibus.common.fairness import VirtualTokenCounters
from omnibus.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from omnibus.engine.core.scheduler import ScheduledSeq

WAITING_ORDERS = ("fifo", "slo")

_Key = tuple[int, float, int]


class WaitingQueue:
    def __init__(self, order: str = "slo", fair_preemption_tokens: int = 16, seats: int = 0) -> None:
        if order not in WAITING_ORDERS:
            raise ValueError(f"waiting order must be one of {WAITING_ORDERS}, got {order!r}")
        self.order = order
        self.fair_preemption_tokens = fair_preemption_tokens
        self.seats = seats  # running sequences at most (the scheduler's max_num_seqs)
        self.counters = VirtualTokenCounters()
        self._seated: Counter[str] = Counter()  # running sequences per tenant
        self._weights: dict[str, float] = {}  # each tenant's share, as its requests carry it
        self._heaps: dict[str, list[tuple[_Key, Sequence]]] = {}  # one per tenant ("" for fifo)

    def _key(self, seq: Sequence) -> _Key:
        if self.order == "fifo":
            return (-seq.priority, 0.0, seq.arrival_index)
        return (-seq.priority, math.inf if seq.deadline is None else seq.deadline, seq.arrival_index)

    def _heap_of(self, seq: Sequence) -> list[tuple[_Key, Sequence]]:
        return self._heaps.setdefault(seq.tenant if self.order == "slo" else "", [])

    def push(self, seq: Sequence, lift: bool = True) -> None:
        """Queues `seq` (status WAITING); its tenant is lifted if it had nothing waiting,
        unless `lift` is False (a request put back in the place it had)."""
        heap = self._heap_of(seq)
        if lift and self.order == "slo" and self._live_head(heap) is None:
            self.counters.lift(seq.tenant, self._backlogged())
        self._weights[seq.tenant] = seq.weight
        heapq.heappush(heap, (self._key(seq), seq))

    def seated(self, seq: Sequence) -> None:
        """`seq` started running."""
        self._seated[seq.tenant] += 1

    def unseated(self, seq: Sequence) -> None:
        """`seq` stopped running (finished, aborted or preempted)."""
        self._seated[seq.tenant] -= 1
        if not self._seated[seq.tenant]:
            del self._seated[seq.tenant]

    def rank(self, seq: Sequence) -> tuple[int, float, float, float, int]:
        """Where `seq` stands in the order, smaller first (priority, deadline, tenant's
        counter, tenant's seats per weight, arrival); the scheduler ranks running requests'
        prefill chunks by it too."""
        k = self._key(seq)
        if self.order == "fifo":
            return (k[0], k[1], 0.0, 0.0, k[2])
        seats = self._seated[seq.tenant] / self._weights.get(seq.tenant, 1.0)
        return (k[0], k[1], self.counters[seq.tenant], seats, k[2])

    def peek(self) -> Sequence | None:
        """The request admitted next, or None."""
        best: tuple | None = None
        chosen = None
        for heap in self._heaps.values():
            seq = self._live_head(heap)
            if seq is None:
                continue
            key = self.rank(seq)
            if best is None or key < best:
                best, chosen = key, seq
        return chosen

    def pop(self, seq: Sequence) -> None:
        """Removes `seq`, which `peek` just returned."""
        heap = self._heap_of(seq)
        heapq.heappop(heap)
        if self.order == "slo" and self._live_head(heap) is None:
            self.counters.left(seq.tenant)

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting requests, in no particular order."""
        for heap in self._heaps.values():
            for _, seq in heap:
                if seq.status is SequenceStatus.WAITING:
                    yield seq

    def charge(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Each planned sequence's tenant is served its tokens this step (summed per
        tenant first: one counter update per tenant, not per sequence)."""
        if self.order != "slo":
            return
        served: dict[tuple[str, float], int] = {}
        for item in scheduled:
            key = (item.seq.tenant, item.seq.weight)
            served[key] = served.get(key, 0) + item.num_tokens
        for (tenant, weight), tokens in served.items():
            self.counters.charge(tenant, tokens, weight)

    # ---- preemption ------------------------------------------------------------

    def victim(self, candidates: Iterable[Sequence], now: float) -> Sequence | None:
        """The running request to preempt first among `candidates`, or None."""
        if self.order == "fifo":
            return max(candidates, key=lambda s: (-s.priority, s.arrival_index), default=None)
        return max(candidates, default=None, key=lambda s: (
            -s.priority,
            math.inf if s.deadline is None else s.deadline - now,
            self.counters[s.tenant],
            s.arrival_index,
        ))

    def may_preempt(self, seq: Sequence, victim: Sequence) -> bool:
        """Whether waiting `seq` may take running `victim`'s place: a strictly higher
        priority, or (slo) the same priority and a tenant served far less or holding
        less than its seat share from one holding more (the module docstring)."""
        if seq.priority != victim.priority:
            return seq.priority > victim.priority
        if self.order != "slo" or seq.tenant == victim.tenant:
            return False
        mine, theirs = self.counters[seq.tenant], self.counters[victim.tenant]
        if mine + self.fair_preemption_tokens < theirs:
            return True
        if mine > theirs or not self.seats:
            return False
        return (self._seated[seq.tenant] + 1 <= self._seat_share(seq.tenant)
                and self._seated[victim.tenant] - 1 >= self._seat_share(victim.tenant))

    def _seat_share(self, tenant: str) -> float:
        """`tenant`'s weighted share of the seats among the tenants running or waiting."""
        active = set(self._seated) | set(self._backlogged()) | {tenant}
        total = sum(self._weights.get(t, 1.0) for t in active)
        return self.seats * self._weights.get(tenant, 1.0) / total

    def _backlogged(self) -> list[str]:
        return [t for t, heap in self._heaps.items() if self._live_head(heap) is not None]

    @staticmethod
    def _live_head(heap: list[tuple[_Key, Sequence]]) -> Sequence | None:
        while heap:
            seq = heap[0][1]
            if seq.status is SequenceStatus.WAITING:
                return seq
            heapq.heappop(heap)  # aborted or finished while waiting
        return None
