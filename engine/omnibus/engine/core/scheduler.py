"""Iteration-level scheduler: plans one engine step at a time.

`schedule()` decides which sequences run this step and how many tokens each
(decodes first, then chunked prefills, running and newly admitted ones in the one
order of core/order.py, within a token budget and a sequence cap),
allocating KV blocks and preempting when the pool runs dry or a waiting request may
displace a running one. Within one call a request is seated at most once and evicted at
most once, so every loop in it is bounded by the requests it holds. `update()` applies the
sampled tokens: advances counts, caches full blocks, detects finished requests and
frees them. Both work without a model, so tests drive them directly.

The scheduler plans the running sequences' chunks itself and coordinates the rest:

- core/lifecycle.py `Lifecycle`: the waiting and running sets and every move between them
  (the one place KV blocks and adapter slots are given back);
- core/admission.py `Admission`: which waiting requests join, the batching policy's
  decision (core/policies.py): continuous batching admits at every step, the others form
  batches;
- core/bookkeeping.py `Bookkeeping`: `update()`;
- core/plan.py: the plan `schedule()` returns (`SchedulerOutput`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from typing import TYPE_CHECKING

from omnibus.engine.core.admission import Admission
from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.bookkeeping import Bookkeeping
from omnibus.engine.core.lifecycle import Lifecycle
from omnibus.engine.core.order import SchedulingOrder
from omnibus.engine.core.plan import ScheduledSeq, SchedulerOutput, plan_chunk
from omnibus.engine.core.policies import BatchingPolicy
from omnibus.engine.core.sequence import RequestOutput, SamplerOutput, Sequence, SequenceStatus
from omnibus.engine.core.study import StepObserver

if TYPE_CHECKING:
    from omnibus.engine.kv_transfer.connector import KvConnector
    from omnibus.engine.lora import LoraManager
    from omnibus.engine.spec import Speculator

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 2048  # tokens computed per step at most
    max_model_len: int = 2048  # prompt + output tokens at most
    waiting_order: str = "slo"  # "slo": near deadlines, then tenant fair share within a priority; "fifo" (core/order.py)
    # The step time assumed until steps are measured: it decides when a deadline is near.
    step_seconds_estimate: float = 0.05


class Scheduler:
    """Plans steps (`schedule`) and applies their results (`update`) over the request
    sets of its `lifecycle`; the engine's one entry to the core."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, policy: BatchingPolicy,
                 eos_token_ids: tuple[int, ...] = (), adapters: "LoraManager | None" = None,
                 speculator: "Speculator | None" = None, kv: "KvConnector | None" = None) -> None:
        self.config = config
        self.allocator = allocator
        self.adapters = adapters  # gates admission: an adapter must be loaded and get a slot
        self.speculator = speculator  # guesses decodes' next tokens (engine/omnibus/engine/spec), or None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.order = SchedulingOrder(config.waiting_order, config.max_num_seqs, config.step_seconds_estimate)
        self.order.budget = config.max_num_batched_tokens
        self.lifecycle = Lifecycle(allocator, self.order, adapters, speculator, kv)
        self._admission = Admission(self.lifecycle, allocator, policy, config.max_num_seqs)
        self._bookkeeping = Bookkeeping(self.lifecycle, allocator, speculator)
        self._last_busy: float | None = None  # when the last non-empty step was planned
        self._now = 0.0  # monotonic seconds of the step being planned
        self.observer: StepObserver | None = None  # the batching study's counters, when on
        self._batch_slots = 0  # formed-batch policies: size of the batch now running

    # ---- what the engine reads (the lifecycle owns them) ---------------------

    @property
    def running(self) -> list[Sequence]:
        """The running sequences, sorted by Sequence.sort_key."""
        return self.lifecycle.running

    @property
    def requests(self) -> dict[str, Sequence]:
        """Every unfinished request, by id."""
        return self.lifecycle.requests

    @property
    def num_waiting(self) -> int:
        return self.lifecycle.num_waiting

    @property
    def num_preemptions(self) -> int:
        return self.lifecycle.num_preemptions

    @property
    def policy(self) -> BatchingPolicy:
        """The batching policy admission follows (the engine swaps it for its warmup)."""
        return self._admission.policy

    @policy.setter
    def policy(self, policy: BatchingPolicy) -> None:
        self._admission.policy = policy

    # ---- requests ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.lifecycle.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if not seq.params.ignore_eos:
            seq.stop_ids |= self.eos_token_ids
        seq.max_len = min(seq.max_len, self.config.max_model_len)
        self.lifecycle.add(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request wherever it is; its blocks are free when this returns. An
        ended request's KV held for a transfer is given back (its reader is done)."""
        seq = self.lifecycle.requests.get(request_id)
        if seq is None:
            return self.lifecycle.release(request_id)
        self.lifecycle.end(seq, "abort")
        return True

    def migrate(self) -> int:
        """Ends every request for another engine to go on with (a drain): running ones
        with their computed KV held for a transfer (each output names it), the rest with
        nothing to move. Returns how many hold KV."""
        life = self.lifecycle
        held = 0
        for seq in list(life.requests.values()):
            life.end(seq, "abort", hold=seq.status is SequenceStatus.RUNNING)
            held += seq.kv_handle is not None
        life.drop_finished()
        return held

    def has_unfinished(self) -> bool:
        return self.lifecycle.has_unfinished()

    def take_aborted(self) -> list[RequestOutput]:
        return self.lifecycle.take_aborted()

    # ---- planning ------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan one step. Sequences keep their place in `running`; the plan lists them
        decodes first so the model can batch them together. Planned tokens count as
        computed from here on (the step that computes them is launched next), and each
        sampling chunk leaves one token pending until `update` reports it."""
        life = self.lifecycle
        life.step += 1
        self._now = time.monotonic() if now is None else now
        life.loaded()  # reads from other engines that finished: those requests run now
        life.expire()
        self._measure_step_time()
        self.order.now = self._now
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        expired: list[tuple[Sequence, float]] = []  # and the deadline that passed
        for seq in life.running:
            if seq.num_pending and seq.planned_len >= seq.max_len:
                continue  # its pending token is its last: nothing to compute until it reports
            if (seq.deadline is not None and self._now >= seq.deadline
                    and not seq.num_pending and not seq.num_output_tokens):
                expired.append((seq, seq.deadline))  # still prefilling: no further chunk
                continue
            left = len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens
            (decodes if left == 1 else prefills).append(seq)
        for seq, deadline in expired:
            self._end_prefilling(seq, deadline)
        # Prefill chunks of running requests that the order ranks after the head of the
        # queue (another tenant's, a near deadline) get the budget it leaves.
        head = life.waiting.peek() if prefills else None
        behind: list[Sequence] = []
        if head is not None:
            cut = self.order.key(head)
            ahead: list[Sequence] = []
            for s in prefills:
                (behind if self.order.key(s) > cut else ahead).append(s)
            prefills = ahead
        idle = not life.running
        guesses = self._guesses(decodes)
        budget = self._plan_running(decodes + prefills, budget, out, guesses)
        budget = self._admission.admit(out, budget, self._now)
        self._plan_running(behind, budget, out)
        out.num_batched_tokens = sum(item.num_tokens for item in out.scheduled)
        life.waiting.charge(out.scheduled)
        if self.adapters is not None:
            # Decodes grouped by adapter slot: one LoRA segment per adapter, not per sequence.
            out.scheduled.sort(key=lambda it: (it.num_tokens > 1, -1 if it.seq.lora_slot is None
                                                else it.seq.lora_slot))
        if idle:
            self._batch_slots = len(life.running)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            item.seq.num_pending += item.samples
        if self.observer is not None and not out.is_empty:
            slots = self._batch_slots if self.policy.forms_batches else len(life.running)
            self.observer.on_step(out.num_batched_tokens, slots, life.running, self.allocator.block_size)
        self._last_busy = None if out.is_empty else self._now
        return out

    def _measure_step_time(self) -> None:
        """The gap since the last non-empty step is one step's time (the loop plans the next
        step as soon as one is launched): a moving average tells deadlines when they are near."""
        if self._last_busy is not None and self._now > self._last_busy:
            self.order.step_seconds += 0.1 * (self._now - self._last_busy - self.order.step_seconds)

    def _end_prefilling(self, seq: Sequence, deadline: float) -> None:
        """End a running request whose deadline passed before its first token (mid-prefill,
        between chunks), as admission ends a waiting one: its KV blocks are freed."""
        self.lifecycle.end(seq, "deadline", f"the request's deadline passed {self._now - deadline:.3f} s "
                           f"into its prefill ({seq.num_computed_tokens} of {seq.num_prompt_tokens} prompt "
                           "tokens computed)")

    def _plan_running(self, seqs: list[Sequence], budget: int, out: SchedulerOutput,
                      guesses: dict[Sequence, list[int]] | None = None) -> int:
        """Plans the next chunk of each running sequence in `seqs` within `budget` (a
        decode with guesses: its input and as many guesses as the budget and the free
        blocks hold; guesses never preempt anyone); returns the budget left."""
        bs, running, step = self.allocator.block_size, SequenceStatus.RUNNING, self.lifecycle.step
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not running or seq.scheduled_step == step:
                continue  # preempted earlier in this step, or preempted and seated again
            start = seq.num_computed_tokens
            n = min(seq.planned_len - start, budget)
            guess = guesses.get(seq) if guesses else None
            if guess:
                guess = guess[:budget - 1]
                if not self.allocator.allocate_slots(seq, start + 1 + len(guess)):
                    guess = []
            # (a decode step's last block mostly has room: no call to the allocator)
            if start + n > len(seq.block_table) * bs and not self._reserve_running(seq, n, out):
                continue
            out.scheduled.append(plan_chunk(seq, n, step, guess or []))
            budget -= n + len(guess or ())
        return budget

    def _guesses(self, decodes: list[Sequence]) -> dict[Sequence, list[int]] | None:
        """The speculator's guesses for this step's decodes (lockstep ones only: a token
        in flight is not known yet), while the batch is small enough for them to pay."""
        spec = self.speculator
        if spec is None or not decodes or not spec.active(len(self.lifecycle.running)):
            return None
        seqs = [s for s in decodes if not s.num_pending and not s.params.speculative_off]
        if not seqs:
            return None
        # each kept guess is an output token: room for them and the target's own pick
        room = [s.max_len - s.num_tokens - 1 for s in seqs]
        return {s: g for s, g in zip(seqs, spec.guesses(seqs, room)) if g}

    def _reserve_running(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for `n` more tokens of a running sequence, preempting the lowest
        priority, latest arrived unscheduled sequence (possibly `seq`) until they fit."""
        while not self.allocator.allocate_slots(seq, seq.num_computed_tokens + n):
            victim = self._preemption_victim()
            self.lifecycle.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preemption_victim(self) -> Sequence:
        """The last in the order (core/order.py) among those neither planned nor seated
        in this step."""
        step = self.lifecycle.step
        victim = self.order.victim(s for s in self.lifecycle.running
                                   if s.scheduled_step != step and s.seated_step != step)
        if victim is None:
            raise RuntimeError("no sequence left to preempt")  # unreachable: the caller is unscheduled
        return victim

    # ---- bookkeeping ---------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> list[RequestOutput]:
        """Apply a step's sampled tokens (core/bookkeeping.py); return one output per
        request that produced a token or finished by it (aborts are reported by
        `take_aborted`)."""
        return self._bookkeeping.update(out, sampled)

    def block_tables(self) -> list[list[int]]:
        return self.lifecycle.block_tables()
