"""The one order over requests: who is admitted next, whose prefill chunk runs first,
who gives up a seat. Admission, prefill ranking and preemption all read `key`.

`key(seq)`, smaller first:

1. priority, higher first;
2. (slo) a *near* deadline, earliest first: a deadline counts once the time left is
   under `URGENCY` times what the request still needs at the engine's recent step time
   (its prompt in chunks of the step budget plus max_tokens decode steps). A far deadline
   ranks like none: a client's RPC timeout is not an SLO;
3. (slo) the tenant's virtual token counter (omnibus.common.fairness, the rule the
   router's queue follows), then the seats per unit of weight its tenant holds with it
   running (a waiting request counts the seat it would take);
4. arrival.

"fifo" keeps only priority and arrival.

A waiting request displaces a running one (`may_displace`) only when it strictly precedes
it, and either has a higher priority or (slo) its tenant holds fewer seats than its
weighted share while the other's tenant holds more. The swap is stable: both keys count
each request's seat as held, so neither key changes with the swap, and the displaced
request still follows the one that took its seat (it cannot take it back). The scheduler
seats a request at most once and evicts one at most once per step, so the number of
preemptions per step is bounded by the running set.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from omnibus.common.fairness import VirtualTokenCounters
from omnibus.engine.core.sequence import Sequence, SequenceStatus

ORDERS = ("fifo", "slo")
URGENCY = 2.0  # a deadline counts once the time left < URGENCY x the time still needed

Key = tuple[int, float, float, float, int]


class SchedulingOrder:
    """The order's state: tenants' counters, weights and running seats, and the clock of
    the step being planned. One owner: the scheduler (the step thread)."""

    def __init__(self, order: str = "slo", seats: int = 0, step_seconds: float = 0.05) -> None:
        if order not in ORDERS:
            raise ValueError(f"waiting order must be one of {ORDERS}, got {order!r}")
        self.order = order
        self.seats = seats  # running sequences at most (the scheduler's max_num_seqs)
        self.now = 0.0  # monotonic seconds of the step being planned
        self.step_seconds = step_seconds  # the engine's recent step time (estimate)
        self.budget = 1 << 30  # tokens per step (prefill chunking)
        self.counters = VirtualTokenCounters()
        self.seated: Counter[str] = Counter()  # running sequences per tenant
        self.weights: dict[str, float] = {}  # each tenant's share, as its requests carry it

    @property
    def fair(self) -> bool:
        return self.order == "slo"

    # ---- the key ------------------------------------------------------------------

    def urgent_at(self, seq: Sequence) -> float:
        """When `seq`'s deadline starts to count (inf: never). Fixed when it is queued."""
        if seq.deadline is None or not self.fair:
            return math.inf
        steps = -(-seq.num_prompt_tokens // self.budget) + seq.params.max_tokens
        return seq.deadline - URGENCY * steps * self.step_seconds

    def deadline_term(self, seq: Sequence) -> float:
        at = seq.urgent_at
        return seq.deadline if at is not None and self.now >= at else math.inf  # type: ignore[return-value]

    def key(self, seq: Sequence) -> Key:
        """Where `seq` stands, smaller first."""
        if not self.fair:
            return (-seq.priority, 0.0, 0.0, 0.0, seq.arrival_index)
        held = self.seated[seq.tenant] + (seq.status is not SequenceStatus.RUNNING)  # with its own seat
        seats = held / self.weights.get(seq.tenant, seq.weight)
        return (-seq.priority, self.deadline_term(seq), self.counters[seq.tenant], seats, seq.arrival_index)

    # ---- seats --------------------------------------------------------------------

    def seat(self, seq: Sequence) -> None:
        self.seated[seq.tenant] += 1

    def unseat(self, seq: Sequence) -> None:
        self.seated[seq.tenant] -= 1
        if not self.seated[seq.tenant]:
            del self.seated[seq.tenant]

    # ---- who gives up a seat ------------------------------------------------------

    def victim(self, candidates: Iterable[Sequence]) -> Sequence | None:
        """The last of `candidates` in the order: the one to preempt first."""
        return max(candidates, key=self.key, default=None)

    def may_displace(self, seq: Sequence, running: Sequence, backlogged: Iterable[str]) -> bool:
        """Whether waiting `seq` may take running `running`'s seat (the module docstring);
        `backlogged` are the tenants with requests waiting (for the seat shares)."""
        if not self.key(seq) < self.key(running):
            return False
        if seq.priority != running.priority:
            return True
        if not self.fair or seq.tenant == running.tenant:
            return False
        active = set(self.seated) | set(backlogged) | {seq.tenant}
        return (self.seated[seq.tenant] + 1 <= self._share(seq.tenant, active)
                and self.seated[running.tenant] - 1 >= self._share(running.tenant, active))

    def _share(self, tenant: str, active: set[str]) -> float:
        """`tenant`'s weighted share of the seats among the `active` tenants."""
        total = sum(self.weights.get(t, 1.0) for t in active)
        return self.seats * self.weights.get(tenant, 1.0) / total
