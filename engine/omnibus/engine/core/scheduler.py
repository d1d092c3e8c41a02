"""Iteration-level scheduler: plans one engine step at a time.

`schedule()` decides which sequences run this step and how many tokens each
(decodes first, then chunked prefills, running and newly admitted ones in the one
order of core/order.py, within a token budget and a sequence cap),
allocating KV blocks and preempting when the pool runs dry or a waiting request may
displace a running one. Within one call a request is seated at most once and evicted at
most once, so every loop in it is bounded by the requests it holds. `update()` applies the
sampled tokens: advances counts, caches full blocks, detects finished requests and
frees them. Both work without a model, so tests drive them directly.

Which waiting requests may join is the batching policy's decision (see
engine/omnibus/engine/core/policies.py): continuous batching admits at every step, the others form
batches.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.order import SchedulingOrder
from omnibus.engine.core.policies import BatchingPolicy
from omnibus.engine.core.sequence import (
    RequestOutput, SamplerOutput, Sequence, SequenceStatus, TokenLogprobs)
from omnibus.engine.core.study import StepObserver
from omnibus.engine.core.waiting import WaitingQueue

if TYPE_CHECKING:
    from omnibus.engine.lora import LoraManager
    from omnibus.engine.spec import Speculator


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences at most
    max_num_batched_tokens: int = 2048  # tokens computed per step at most
    max_model_len: int = 2048  # prompt + output tokens at most
    waiting_order: str = "slo"  # "slo": near deadlines, then tenant fair share within a priority; "fifo" (core/order.py)
    # The step time assumed until steps are measured: it decides when a deadline is near.
    step_seconds_estimate: float = 0.05


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first token computed this step (the sequence's num_computed_tokens)
    num_tokens: int  # tokens computed this step
    samples: bool  # True when this chunk reaches the end, so the next token is sampled
    # Speculated tokens after a decode's input (engine/omnibus/engine/spec): the step scores each, and the
    # target's own picks decide how many are kept. Rows sampled: samples + len(guess).
    guess: list[int] = field(default_factory=list)
    # Positions of this chunk whose logits score the next prompt token (the request asked
    # for prompt logprobs and has not scored it yet); None: none.
    prompt_rows: range | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, policy: BatchingPolicy,
                 eos_token_ids: tuple[int, ...] = (), adapters: "LoraManager | None" = None,
                 speculator: "Speculator | None" = None) -> None:
        self.config = config
        self.allocator = allocator
        self.policy = policy
        self.adapters = adapters  # gates admission: an adapter must be loaded and get a slot
        self.speculator = speculator  # guesses decodes' next tokens (engine/omnibus/engine/spec), or None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Sequence] = {}  # every unfinished request
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.order = SchedulingOrder(config.waiting_order, config.max_num_seqs, config.step_seconds_estimate)
        self.order.budget = config.max_num_batched_tokens
        self._waiting = WaitingQueue(self.order)
        self._last_busy: float | None = None  # when the last non-empty step was planned
        self.num_waiting = 0
        self._aborted: list[RequestOutput] = []  # reported by the next update()
        self._step = 0
        self._now = 0.0  # monotonic seconds of the step being planned
        self.num_preemptions = 0
        self.observer: StepObserver | None = None  # the batching study's counters, when on
        self._batch_slots = 0  # formed-batch policies: size of the batch now running

    # ---- requests ------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        if not seq.params.ignore_eos:
            seq.stop_ids |= self.eos_token_ids
        seq.max_len = min(seq.max_len, self.config.max_model_len)
        self.requests[seq.request_id] = seq
        self._push_waiting(seq)

    def abort(self, request_id: str) -> bool:
        """Finish a request wherever it is; its blocks are free when this returns."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._leave_running(seq)
        else:
            self.num_waiting -= 1
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self._aborted.append(self._output(seq, [], []))
        return True

    def _leave_running(self, seq: Sequence) -> None:
        """The one exit from the running set: blocks back to the pool, adapter slot unpinned
        (also frees the blocks of a waiting request whose admission failed)."""
        if seq.status is SequenceStatus.RUNNING:
            self.order.unseat(seq)
        self.allocator.free(seq)
        if seq.lora_slot is not None and seq.adapter is not None:
            self._lora().release(seq.adapter)
            seq.lora_slot = None
        if self.speculator is not None:
            self.speculator.proposer.release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def take_aborted(self) -> list[RequestOutput]:
        out, self._aborted = self._aborted, []
        return out

    # ---- planning ------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan one step. Sequences keep their place in `running`; the plan lists them
        decodes first so the model can batch them together. Planned tokens count as
        computed from here on (the step that computes them is launched next), and each
        sampling chunk leaves one token pending until `update` reports it."""
        self._step += 1
        self._now = time.monotonic() if now is None else now
        self._measure_step_time()
        self.order.now = self._now
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        expired: list[tuple[Sequence, float]] = []  # and the deadline that passed
        for seq in self.running:
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
        head = self._waiting.peek() if prefills else None
        behind: list[Sequence] = []
        if head is not None:
            cut = self.order.key(head)
            ahead: list[Sequence] = []
            for s in prefills:
                (behind if self.order.key(s) > cut else ahead).append(s)
            prefills = ahead
        idle = not self.running
        guesses = self._guesses(decodes)
        budget = self._plan_running(decodes + prefills, budget, out, guesses)
        budget = self._admit(out, budget, self._now)
        self._plan_running(behind, budget, out)
        out.num_batched_tokens = sum(item.num_tokens for item in out.scheduled)
        self._waiting.charge(out.scheduled)
        if self.adapters is not None:
            # Decodes grouped by adapter slot: one LoRA segment per adapter, not per sequence.
            out.scheduled.sort(key=lambda it: (it.num_tokens > 1, -1 if it.seq.lora_slot is None
                                                else it.seq.lora_slot))
        if idle:
            self._batch_slots = len(self.running)
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            item.seq.num_pending += item.samples
        if self.observer is not None and not out.is_empty:
            slots = self._batch_slots if self.policy.forms_batches else len(self.running)
            self.observer.on_step(out.num_batched_tokens, slots, self.running, self.allocator.block_size)
        self._last_busy = None if out.is_empty else self._now
        return out

    def _measure_step_time(self) -> None:
        """The gap since the last non-empty step is one step's time (the loop plans the next
        step as soon as one is launched): a moving average tells deadlines when they are near."""
        if self._last_busy is not None and self._now > self._last_busy:
            self.order.step_seconds += 0.1 * (self._now - self._last_busy - self.order.step_seconds)

    def _end_prefilling(self, seq: Sequence, deadline: float) -> None:
        """End a running request whose deadline passed before its first token (mid-prefill,
        between chunks), as `_admit` ends a waiting one: its KV blocks are freed."""
        self.running.remove(seq)
        self._leave_running(seq)
        self._end(seq, "deadline", f"the request's deadline passed {self._now - deadline:.3f} s "
                  f"into its prefill ({seq.num_computed_tokens} of {seq.num_prompt_tokens} prompt "
                  "tokens computed)")

    def _plan_running(self, seqs: list[Sequence], budget: int, out: SchedulerOutput,
                      guesses: dict[Sequence, list[int]] | None = None) -> int:
        """Plans the next chunk of each running sequence in `seqs` within `budget` (a
        decode with guesses: its input and as many guesses as the budget and the free
        blocks hold; guesses never preempt anyone); returns the budget left."""
        bs, running = self.allocator.block_size, SequenceStatus.RUNNING
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not running or seq.scheduled_step == self._step:
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
            out.scheduled.append(self._plan(seq, n, guess or []))
            budget -= n + len(guess or ())
        return budget

    def _guesses(self, decodes: list[Sequence]) -> dict[Sequence, list[int]] | None:
        """The speculator's guesses for this step's decodes (lockstep ones only: a token
        in flight is not known yet), while the batch is small enough for them to pay."""
        spec = self.speculator
        if spec is None or not decodes or not spec.active(len(self.running)):
            return None
        seqs = [s for s in decodes if not s.num_pending and not s.params.speculative_off]
        if not seqs:
            return None
        # each kept guess is an output token: room for them and the target's own pick
        room = [s.max_len - s.num_tokens - 1 for s in seqs]
        return {s: g for s, g in zip(seqs, spec.guesses(seqs, room)) if g}

    def _plan(self, seq: Sequence, n: int, guess: list[int] | None = None) -> ScheduledSeq:
        seq.scheduled_step = self._step
        start = seq.num_computed_tokens
        item = ScheduledSeq(seq, start, n, start + n == seq.planned_len)
        if seq.prompt_logprobs is not None:
            # from the first position not scored yet (a chunk recomputed after a
            # preemption may start before it) up to the one before the last prompt token
            rows = range(max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1))
            item.prompt_rows = rows or None
        if guess:
            item.guess = guess
            item.num_tokens += len(guess)
        return item

    def _reserve_running(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for `n` more tokens of a running sequence, preempting the lowest
        priority, latest arrived unscheduled sequence (possibly `seq`) until they fit."""
        while not self.allocator.allocate_slots(seq, seq.num_computed_tokens + n):
            victim = self._preemption_victim()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preemption_victim(self) -> Sequence:
        """The last in the order (core/order.py) among those neither planned nor seated
        in this step."""
        step = self._step
        victim = self.order.victim(s for s in self.running if s.scheduled_step != step and s.seated_step != step)
        if victim is None:
            raise RuntimeError("no sequence left to preempt")  # unreachable: the caller is unscheduled
        return victim

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV (prefix-cached blocks stay reusable)."""
        self.running.remove(seq)
        self._leave_running(seq)
        seq.num_computed_tokens = 0
        seq.evicted_step = self._step
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(seq)

    def _admit(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Admits waiting requests in the order; returns the budget left. Each pass takes
        the head off the queue (seated, deferred or ended) or stops, so the loop runs at
        most once per waiting request."""
        limit = self.policy.admission_limit(now, len(self.running), self.num_waiting, self._oldest_arrival)
        room = min(limit, self.config.max_num_seqs - len(self.running))
        seated = len(self.running)
        deferred: list[Sequence] = []  # waiting on their adapter or a token: others may pass them
        # A formed batch is admitted whole (its KV reserved) even when this step's token
        # budget runs out: the prefill of its later members continues in the next steps.
        # With no seat left, the head may still displace a running request (a planned
        # one refunds its tokens), so a light tenant need not wait for a step with budget.
        for _ in range(self.num_waiting + len(self.running)):  # each running one is evicted at most once
            if budget <= 0 and room > 0 and not self.policy.forms_batches:
                break
            seq = self._waiting.peek()
            if seq is None:
                break
            self._waiting.pop(seq)
            if seq.evicted_step == self._step:  # seated at most once, evicted at most once per step:
                deferred.append(seq)  # it waits for the next step, and nobody passes it
                break
            if seq.num_pending:  # preempted with a token in flight: it rejoins once that reports
                deferred.append(seq)
                continue
            if seq.deadline is not None and now >= seq.deadline:
                self._end_waiting(seq, "deadline", f"the request's deadline passed {now - seq.deadline:.3f} s "
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
                self._leave_running(seq)  # unpins the adapter slot the gate pinned
                deferred.append(seq)
                break  # strict order: the head waits for a seat or blocks
            planned, refunded, freed = seat
            budget, room = budget - planned + refunded, room - 1 + freed
        for seq in deferred:
            self._waiting.push(seq, lift=False)
        if limit and self.policy.forms_batches:
            self.policy.admitted(limit, len(self.running) - seated)
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
        cached = self.allocator.allocate_prefix(seq, limit)
        n = min(seq.num_tokens - cached, budget + refunds)
        reserve = max(cached + n, self.policy.reserve_tokens(seq))
        while not self.allocator.allocate_slots(seq, reserve):  # each pass evicts one request
            refund = self._displace_for(seq, out)
            if refund is None:
                return None
            refunds, freed = refunds + refund, freed + 1
            n = min(seq.num_tokens - cached, budget + refunds)
            reserve = max(cached + n, self.policy.reserve_tokens(seq))
        self._start_running(seq, cached, n, out)
        return n, refunds, freed

    def _start_running(self, seq: Sequence, cached: int, n: int, out: SchedulerOutput) -> None:
        self.num_waiting -= 1
        seq.num_computed_tokens = cached
        if not seq.first_scheduled:
            seq.first_scheduled, seq.num_cached_tokens = True, cached
        seq.status = SequenceStatus.RUNNING
        seq.seated_step = self._step
        self.order.seat(seq)
        bisect.insort(self.running, seq, key=Sequence.sort_key)
        if n > 0:
            out.scheduled.append(self._plan(seq, n))

    def _displace_for(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Preempt the running request that waiting `seq` may displace (core/order.py) and
        that comes last in the order, if any (never one seated in this step; formed batches
        never displace). A victim already planned for this step leaves the plan; returns
        the tokens that frees from the step's budget, or None when there is no such victim."""
        if self.policy.forms_batches:
            return None
        step, backlogged = self._step, self._waiting.backlogged()
        victim = self.order.victim(r for r in self.running
                                   if r.seated_step != step and self.order.may_displace(seq, r, backlogged))
        if victim is None:
            return None
        refund = sum(item.num_tokens for item in out.scheduled if item.seq is victim)
        if refund:
            out.scheduled = [item for item in out.scheduled if item.seq is not victim]
        self._preempt(victim)
        out.preempted.append(victim)
        return refund

    def _adapter_gate(self, seq: Sequence) -> str:
        """"ok" (base model, or adapter loaded into a pinned slot), "wait" (loading, or
        every slot pinned by running sequences) or "failed" (the request is finished)."""
        if seq.adapter is None or seq.lora_slot is not None:  # base model, or pinned already
            return "ok"
        gate = self._lora().gate(seq.adapter)
        if gate.error is not None:
            del self.requests[seq.request_id]
            self.num_waiting -= 1
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            out = self._output(seq, [], [])
            out.error = gate.error
            self._aborted.append(out)
            return "failed"
        seq.lora_slot = gate.slot
        if seq.lora_slot is None:
            return "wait"
        if gate.salt is not None and gate.salt != seq.adapter_salt:
            # Its adapter's files were read again after it arrived (it left memory, and was
            # rewritten): its KV will be these weights', so it is salted and hashed as theirs.
            seq.adapter_salt = gate.salt
            seq.block_hashes.clear()
        return "ok"

    def _end_waiting(self, seq: Sequence, reason: str, error: str) -> None:
        """Finish a waiting request the engine itself ends; `error` says why."""
        self.num_waiting -= 1
        self._end(seq, reason, error)

    def _end(self, seq: Sequence, reason: str, error: str) -> None:
        """Finish a request the engine itself ends, out of the running and waiting sets."""
        del self.requests[seq.request_id]
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        out = self._output(seq, [], [])
        out.error = error
        self._aborted.append(out)

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._waiting.push(seq)
        self.num_waiting += 1

    def _oldest_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request (O(waiting); only the batch-forming
        policies ask, and only while nothing runs)."""
        return min((s.arrival_time for s in self._waiting), default=None)

    # ---- bookkeeping ---------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return one output per request that produced a
        token or finished by it (aborts are reported by `take_aborted`). A sequence preempted
        after the step was launched still gets its token: it was computed from its whole
        context, and recomputing the prefix later reproduces the same KV."""
        results: list[RequestOutput] = []
        row = 0
        finished = False
        running, done = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        # A block fills up once every block_size tokens: only then is it worth a call.
        bs = self.allocator.block_size if self.allocator.enable_prefix_caching else 1 << 62
        if sampled is not None and sampled.prompt_logprobs:
            self._score_prompts(sampled.prompt_logprobs)
        picks = sampled.token_ids if sampled is not None else []  # None: no row sampled
        picked_logprobs = sampled.logprobs if sampled is not None else []
        for item in out.scheduled:
            seq = item.seq
            first = row
            row += item.samples + len(item.guess)
            status = seq.status
            if status is done:
                continue  # aborted, or ended by an earlier step's token while this one ran
            tokens = seq.token_ids
            new: list[int] = []
            if item.samples:
                seq.num_pending -= 1
                new = picks[first:row]
                if item.guess:
                    new = self._kept(item, new)
                token = new[0]
                tokens.append(token)
            if status is running and seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * bs:
                self.allocator.cache_blocks(seq)  # blocks this step filled
            if not item.samples:
                continue
            reason = self._ends(seq, token)
            emitted = 1
            while reason is None and emitted < len(new):  # kept guesses, then the target's pick
                token = new[emitted]
                tokens.append(token)
                emitted += 1
                reason = self._ends(seq, token)
            if item.guess:
                self._spec().stats.emitted += emitted
            if reason is not None:
                finished |= status is running
                self._finish(seq, reason)
            lps = [lp for lp in picked_logprobs[first:first + emitted] if lp is not None]
            result = self._output(seq, tokens[len(tokens) - emitted:], lps)
            if seq.prompt_logprobs is not None:  # its first token: the prompt is scored
                result.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            results.append(result)
        if finished:
            self.running = [s for s in self.running if s.status is running]
        return results

    @staticmethod
    def _score_prompts(computed: dict[Sequence, tuple[int, list[TokenLogprobs]]]) -> None:
        """Appends each sequence's newly scored prompt tokens. Steps report in launch
        order and a sequence reads no cached KV past what it has scored, so a chunk starts
        at or before the first position missing (before it: recomputed after a preemption
        while the earlier chunk was in flight, already scored)."""
        for seq, (first, logprobs) in computed.items():
            have = seq.prompt_logprobs
            if have is None:  # reported already (not reached: its first token comes last)
                continue
            if first > len(have):
                raise RuntimeError(f"prompt logprobs of {seq.request_id}: position {first} scored "
                                   f"before position {len(have)}")
            have += logprobs[len(have) - first:]

    @staticmethod
    def _ends(seq: Sequence, token: int) -> str | None:
        """Why `seq` ends with `token`, just appended (None: it goes on). A structured-output
        request's grammar follows every token it emits, and ends it ("stop") when complete."""
        if token in seq.stop_ids:
            return "stop"
        if len(seq.token_ids) >= seq.max_len:
            return "length"
        if seq.grammar is not None and seq.grammar.advance(token):
            return "stop"
        return None

    def _lora(self) -> LoraManager:
        """The adapter manager: only requests for an adapter reach it, and the engine
        refuses those when it serves no adapters."""
        if self.adapters is None:
            raise RuntimeError("a request for an adapter reached a scheduler without adapters")
        return self.adapters

    def _spec(self) -> Speculator:
        """The speculator: only its own guesses reach it."""
        if self.speculator is None:
            raise RuntimeError("a guessed token reached a scheduler without a speculator")
        return self.speculator

    def _kept(self, item: ScheduledSeq, picks: list[int]) -> list[int]:
        """The tokens a speculating decode emits: the guesses the target's picks confirm,
        then the target's pick after them. The KV of the rest was computed for guesses
        that were wrong: it is dropped (and its blocks freed) at once."""
        seq = item.seq
        kept = self._spec().verified(item.guess, picks)
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= len(item.guess) - kept
            self.allocator.trim(seq, seq.num_computed_tokens)
        return picks[:kept + 1]

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        else:  # preempted while its last token was in flight; its heap entry is skipped lazily
            self.num_waiting -= 1
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self.requests[seq.request_id]

    @staticmethod
    def _output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        # positional, in RequestOutput's field order: this runs for every token of a step
        return RequestOutput(seq.request_id, tokens, logprobs, seq.status is SequenceStatus.FINISHED,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                             len(seq.token_ids) - seq.num_prompt_tokens)

    def block_tables(self) -> list[list[int]]:
        return [s.block_table for s in self.running]
