"""Admission: which waiting requests join the running set at a step.

Requests are taken in the one order of core/order.py, as many as the batching policy
allows (core/policies.py: continuous batching admits at every step, the others form
batches). A request joins once its adapter holds a device slot (`_adapter_gate`) and its
KV fits: the cached prefix, then this step's chunk or the policy's reservation (`_seat`).
With no seat or no blocks left it may displace a running request it strictly precedes
(`_displace_for`, `SchedulingOrder.may_displace`); formed batches never displace. Within
one step a request is seated at most once and evicted at most once, so every loop here is
bounded by the requests the scheduler holds.
"""

from __future__ import annotations

from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.lifecycle import Lifecycle
from omnibus.engine.core.plan import SchedulerOutput, plan_chunk
from omnibus.engine.core.policies import BatchingPolicy
from omnibus.engine.core.sequence import Sequence


class Admission:
    """Seats waiting requests for the scheduler, through its `Lifecycle`."""

    def __init__(self, lifecycle: Lifecycle, allocator: BlockAllocator, policy: BatchingPolicy,
                 max_num_seqs: int) -> None:
        self.policy = policy  # who may join, and the KV each reserves (Scheduler.policy)
        self._life = lifecycle
        self._allocator = allocator
        self._max_num_seqs = max_num_seqs  # running sequences at most

    def admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Admits waiting requests in the order; returns the budget left. Each pass takes
        the head off the queue (seated, deferred or ended) or stops, so the loop runs at
        most once per waiting request."""
        life = self._life
        limit = self.policy.admission_limit(now, len(life.running), life.num_waiting, self._oldest_arrival)
        room = min(limit, self._max_num_seqs - len(life.running) - len(life.loading))
        seated = len(life.running)
        deferred: list[Sequence] = []  # waiting on their adapter or a token: others may pass them
        # A formed batch is admitted whole (its KV reserved) even when this step's token
        # budget runs out: the prefill of its later members continues in the next steps.
        # With no seat left, the head may still displace a running request (a planned
        # one refunds its tokens), so a light tenant need not wait for a step with budget.
        for _ in range(life.num_waiting + len(life.running)):  # each running one is evicted at most once
            if budget <= 0 and room > 0 and not self.policy.forms_batches:
                break
            seq = life.waiting.peek()
            if seq is None:
                break
            life.waiting.pop(seq)
            if seq.evicted_step == life.step:  # seated at most once, evicted at most once per step:
                deferred.append(seq)  # it waits for the next step, and nobody passes it
                break
            if seq.num_pending:  # preempted with a token in flight: it rejoins once that reports
                deferred.append(seq)
                continue
            if seq.deadline is not None and now >= seq.deadline:
                life.end(seq, "deadline", f"the request's deadline passed {now - seq.deadline:.3f} s "
                         "before the engine could prefill it")
                continue
            # The adapter first: a head waiting on it must not displace anyone for a seat
            # it cannot take.
            gate = self._adapter_gate(seq)
            if gate != "ok":
                if gate == "wait":
                    deferred.append(seq)
                continue
            seat = self._seat(seq, out, budget, room)
            if seat is None:
                life.leave_running(seq)  # unpins the adapter slot the gate pinned
                deferred.append(seq)
                break  # strict order: the head waits for a seat or blocks
            planned, refunded, freed = seat
            budget, room = budget - planned + refunded, room - 1 + freed
        for seq in deferred:
            life.waiting.push(seq, lift=False)
        if limit and self.policy.forms_batches:
            self.policy.admitted(limit, len(life.running) - seated)
        return budget

    def _seat(self, seq: Sequence, out: SchedulerOutput, budget: int, room: int) -> tuple[int, int, int] | None:
        """Seats `seq`, displacing running requests it may displace when there is no seat
        or no blocks; returns (tokens planned, tokens refunded, seats freed), or None when
        it must wait (nothing it may displace is left)."""
        refunds = freed = 0
        if room <= 0:
            refund = self._displace_for(seq, out)
            if refund is None:
                return None
            refunds, freed = refund, 1
        # A request scoring its prompt reads no cached blocks past the positions it has
        # scored: the logits of the rest are needed.
        limit = None if seq.prompt_logprobs is None else len(seq.prompt_logprobs)
        cached = self._allocator.allocate_prefix(seq, limit)
        # KV that another engine holds for it (past the local hit) is read, not computed.
        src = seq.kv_source
        loads = src.num_tokens if src is not None and src.num_tokens > cached else 0
        # A prefill for another engine that hands its KV on when seated (an early handle
        # names its blocks) holds blocks for its whole prompt from the start.
        early = seq.kv_hold and not seq.num_output_tokens and self._life.kv is not None and self._life.kv.overlaps

        def wanted() -> tuple[int, int]:  # tokens planned now, tokens to hold blocks for
            # A loading request holds blocks for its whole context: its first step, once the
            # read lands, computes the token after the read ones (seated then, it is no
            # preemption victim, so that step must not need a block more).
            n = 0 if loads else min(seq.num_tokens - cached, budget + refunds)
            return n, max(seq.num_tokens if loads or early else cached + n, self.policy.reserve_tokens(seq))

        n, reserve = wanted()
        while not self._allocator.allocate_slots(seq, reserve):  # each pass evicts one request
            refund = self._displace_for(seq, out)
            if refund is None:
                return None
            refunds, freed = refunds + refund, freed + 1
            n, reserve = wanted()
        if loads:
            self._life.load(seq, cached)
            return 0, refunds, freed
        self._life.seat(seq, cached)
        if early:
            self._life.hold_early(seq)
        if n > 0:
            out.scheduled.append(plan_chunk(seq, n, self._life.step))
        return n, refunds, freed

    def _displace_for(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Preempt the running request that waiting `seq` may displace (core/order.py) and
        that comes last in the order, if any (never one seated in this step; formed batches
        never displace). A victim already planned for this step leaves the plan; returns
        the tokens that frees from the step's budget, or None when there is no such victim."""
        if self.policy.forms_batches:
            return None
        life, order = self._life, self._life.order
        step, backlogged = life.step, life.waiting.backlogged()
        victim = order.victim(r for r in life.running
                              if r.seated_step != step and order.may_displace(seq, r, backlogged))
        if victim is None:
            return None
        refund = sum(item.num_tokens for item in out.scheduled if item.seq is victim)
        if refund:
            out.scheduled = [item for item in out.scheduled if item.seq is not victim]
        life.preempt(victim)
        out.preempted.append(victim)
        return refund

    def _adapter_gate(self, seq: Sequence) -> str:
        """"ok" (base model, or adapter loaded into a pinned slot), "wait" (loading, or
        every slot pinned by running sequences) or "failed" (the request is finished)."""
        if seq.adapter is None or seq.lora_slot is not None:  # base model, or pinned already
            return "ok"
        gate = self._life.lora().gate(seq.adapter)
        if gate.error is not None:
            self._life.end(seq, "abort", gate.error)
            return "failed"
        seq.lora_slot = gate.slot
        if seq.lora_slot is None:
            return "wait"
        if gate.salt is not None and gate.salt != seq.adapter_salt:
            # Its adapter's files were read again after it arrived (it left memory, and was
            # rewritten): its KV will be these weights', so it is salted and hashed as theirs.
            seq.adapter_salt = gate.salt
            seq.block_hashes.clear()
            seq.kv_source = None  # another engine's KV of it was computed under the old weights
        return "ok"

    def _oldest_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request (O(waiting); only the batch-forming
        policies ask, and only while nothing runs)."""
        return min((s.arrival_time for s in self._life.waiting), default=None)
