"""The scheduler's waiting queue and its choice of preemption victim, under one order.

- "fifo": higher priority first, then earlier arrival; the victim is the lowest
  priority, latest arrival.
- "slo" (the default): within a priority, requests with a deadline first, earliest
  deadline first (EDF); then the tenant with the smallest virtual token counter
  (omnibus.common.fairness, the rule the router's queue follows), then arrival. The
  victim is the lowest priority, then the most slack (time to its deadline; none is
  infinite), then the most-served tenant, then the latest arrival. A waiting request
  may also preempt an equal-priority request of another tenant whose counter exceeds
  its own tenant's by more than `fair_preemption_tokens`, so a router that overfills
  the engine gets a light tenant a seat without waiting for a heavy one to finish.

Entries of requests that left the queue otherwise (aborted, finished) are skipped
lazily, as the scheduler's heap always did.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator

from omnibus.common.fairness import VirtualTokenCounters
from omnibus.engine.core.sequence import Sequence, SequenceStatus

WAITING_ORDERS = ("fifo", "slo")

_Key = tuple[int, float, int]


class WaitingQueue:
    def __init__(self, order: str = "slo", fair_preemption_tokens: int = 16) -> None:
        if order not in WAITING_ORDERS:
            raise ValueError(f"waiting order must be one of {WAITING_ORDERS}, got {order!r}")
        self.order = order
        self.fair_preemption_tokens = fair_preemption_tokens
        self.counters = VirtualTokenCounters()
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
        heapq.heappush(heap, (self._key(seq), seq))

    def peek(self) -> Sequence | None:
        """The request admitted next, or None."""
        best: tuple | None = None
        chosen = None
        for heap in self._heaps.values():
            seq = self._live_head(heap)
            if seq is None:
                continue
            k = self._key(seq)
            key = (k[0], k[1], self.counters[seq.tenant], k[2])
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

    def charge(self, seq: Sequence, tokens: int) -> None:
        """`seq`'s tenant was served `tokens` tokens this step."""
        if self.order == "slo":
            self.counters.charge(seq.tenant, tokens, seq.weight)

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
        priority, or (slo) the same priority and a tenant served far less."""
        if seq.priority != victim.priority:
            return seq.priority > victim.priority
        return (
            self.order == "slo"
            and seq.tenant != victim.tenant
            and self.counters[seq.tenant] + self.fair_preemption_tokens < self.counters[victim.tenant]
        )

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
