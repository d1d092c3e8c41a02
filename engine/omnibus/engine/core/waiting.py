"""The scheduler's waiting queue, kept in the one order of core/order.py.

One queue per tenant ("" for all under fifo), each a pair of heaps: every request by
(priority, arrival), and those whose deadline has become near by (priority, deadline,
arrival); a third heap holds the requests with a deadline not yet near, by the time it
becomes near, and feeds the second as the clock passes. A tenant's head is the smaller of
the two heads; `peek` compares the tenants' heads by `SchedulingOrder.key`.

Entries of requests that left the queue (admitted, aborted, finished) or were queued
again are skipped lazily: an entry is live while its stamp is its request's latest.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omnibus.engine.core.order import SchedulingOrder
from omnibus.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from omnibus.engine.core.plan import ScheduledSeq

_stamps = itertools.count(1)


@dataclass
class _TenantQueue:
    by_arrival: list[tuple[tuple[int, int], int, Sequence]] = field(default_factory=list)
    # near ones (each has a deadline, which its type does not say)
    by_deadline: list[tuple[tuple[int, float | None, int], int, Sequence]] = field(default_factory=list)
    nearing: list[tuple[float, int, int, Sequence]] = field(default_factory=list)  # (urgent_at, ...)

    def head(self, now: float) -> Sequence | None:
        while self.nearing and self.nearing[0][0] <= now:
            _, _, stamp, seq = heapq.heappop(self.nearing)
            if _live(stamp, seq):
                heapq.heappush(self.by_deadline, ((-seq.priority, seq.deadline, seq.arrival_index), stamp, seq))
        first = _live_head(self.by_arrival)
        near = _live_head(self.by_deadline)
        if near is None or first is None:
            return near or first
        return near if (-near.priority, near.deadline) <= (-first.priority, math.inf) else first


def _live(stamp: int, seq: Sequence) -> bool:
    return seq.queue_stamp == stamp and seq.status is SequenceStatus.WAITING


def _live_head(heap: list[tuple[Any, int, Sequence]]) -> Sequence | None:
    while heap:
        if _live(heap[0][-2], heap[0][-1]):
            return heap[0][-1]
        heapq.heappop(heap)
    return None


class WaitingQueue:
    def __init__(self, order: SchedulingOrder) -> None:
        self.order = order
        self._queues: dict[str, _TenantQueue] = {}

    def _queue_of(self, seq: Sequence) -> _TenantQueue:
        return self._queues.setdefault(seq.tenant if self.order.fair else "", _TenantQueue())

    def push(self, seq: Sequence, lift: bool = True) -> None:
        """Queues `seq` (status WAITING); its tenant is lifted if it had nothing waiting,
        unless `lift` is False (a request put back in the place it had)."""
        q = self._queue_of(seq)
        if lift and self.order.fair and _live_head(q.by_arrival) is None:
            self.order.counters.lift(seq.tenant, self.backlogged())
        self.order.weights[seq.tenant] = seq.weight
        if seq.urgent_at is None:  # first queued: when its deadline starts to count is fixed
            seq.urgent_at = self.order.urgent_at(seq)
        seq.queue_stamp = stamp = next(_stamps)
        heapq.heappush(q.by_arrival, ((-seq.priority, seq.arrival_index), stamp, seq))
        if seq.urgent_at != math.inf:
            heapq.heappush(q.nearing, (seq.urgent_at, seq.arrival_index, stamp, seq))

    def peek(self) -> Sequence | None:
        """The request admitted next, or None."""
        best, chosen = None, None
        for q in self._queues.values():
            seq = q.head(self.order.now)
            if seq is None:
                continue
            key = self.order.key(seq)
            if best is None or key < best:
                best, chosen = key, seq
        return chosen

    def pop(self, seq: Sequence) -> None:
        """Removes `seq` (which `peek` just returned) from the queue."""
        seq.queue_stamp = 0
        if self.order.fair and _live_head(self._queue_of(seq).by_arrival) is None:
            self.order.counters.left(seq.tenant)

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting requests, in no particular order."""
        for q in self._queues.values():
            for _, stamp, seq in q.by_arrival:
                if _live(stamp, seq):
                    yield seq

    def backlogged(self) -> list[str]:
        """Tenants with requests waiting."""
        return [t for t, q in self._queues.items() if _live_head(q.by_arrival) is not None]

    def charge(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Each planned sequence's tenant is served the tokens of this step that no step
        computed for it before (summed per tenant first: one counter update per tenant).
        A preempted request's recompute is the engine's doing, not service: charging it
        let two tenants take turns preempting each other as their counters crossed, each
        recompute pushing the recomputing one past the other, with no token ever finished
        (a livelock the scheduler simulator found). Charged only for new tokens, counters
        cross only as real tokens are computed, so every preemption follows progress."""
        if not self.order.fair:
            return
        served: dict[tuple[str, float], int] = {}
        for item in scheduled:
            seq = item.seq
            end = seq.num_computed_tokens + item.num_tokens
            fresh = end - seq.num_charged_tokens
            if fresh <= 0:
                continue
            seq.num_charged_tokens = end
            key = (seq.tenant, seq.weight)
            served[key] = served.get(key, 0) + fresh
        for (tenant, weight), tokens in served.items():
            self.order.counters.charge(tenant, tokens, weight)
