"""Where each unfinished request is, and the one definition of every move between.

A request waits (in the queue of core/waiting.py) or runs (holding a seat, KV blocks and
perhaps an adapter slot) until it finishes. `Lifecycle` owns those sets, their counts and
the number of the step being planned, and makes every move: `add` (arrival), `seat`
(admitted), `preempt` (by recompute, back to the queue), `finish` (by a token of a step's
results) and `end` (an abort, or the engine ending it: deadline, adapter failure).
`leave_running` is the one place a request gives back its KV blocks (only the blocks of
rejected guesses are trimmed elsewhere: core/bookkeeping.py) and its adapter slot.
Requests ended outside a step's results are reported by `take_aborted`.

KV that moves (kv_transfer/connector.py, `kv`): a request whose KV arrives from another
engine is seated LOADING (`load`: blocks held, no tokens planned) and joins the running
set when the read is done (`loaded`), from the arrived tokens or, if the read failed,
from its local prefix. A request that ends for a transfer keeps its computed blocks
under the connector's lease (`leave_running` with `hold`) until the reader's router
releases them (`release`) or the lease runs out (`expire`). A prefill for another engine
may hand its KV on as soon as it is seated (`hold_early`: its output ends it for the
router, the engine computes on); it leaves by `finish`, or ends if preempted (its reader
recomputes: nobody waits for it here).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.order import SchedulingOrder
from omnibus.engine.core.sequence import RequestOutput, Sequence, SequenceStatus, TokenLogprobs
from omnibus.engine.core.waiting import WaitingQueue

if TYPE_CHECKING:
    from omnibus.engine.kv_transfer.connector import KvConnector
    from omnibus.engine.lora import LoraManager
    from omnibus.engine.spec import Speculator


class Lifecycle:
    """The request sets. One owner: the scheduler (the step thread); its admission and
    bookkeeping move requests only through these verbs."""

    def __init__(self, allocator: BlockAllocator, order: SchedulingOrder,
                 adapters: LoraManager | None = None, speculator: Speculator | None = None,
                 kv: KvConnector | None = None) -> None:
        self.allocator = allocator
        self.order = order
        self.adapters = adapters  # the adapter slots requests pin while they run, or None
        self.speculator = speculator  # its proposer may hold state per running request, or None
        self.kv = kv  # KV transfer between engines (--kv-transfer), or None
        self.loading: list[Sequence] = []  # seated LOADING, or ended while their read runs
        self.requests: dict[str, Sequence] = {}  # every unfinished request
        self.running: list[Sequence] = []  # kept sorted by Sequence.sort_key
        self.waiting = WaitingQueue(order)
        self.num_waiting = 0
        self.num_preemptions = 0
        # The step being planned (Scheduler.schedule counts them): within one, a request is
        # seated at most once and evicted at most once (Sequence.seated_step, evicted_step).
        self.step = 0
        # reported by the next take_aborted(): ended outside a step's results (and early handles)
        self._aborted: list[RequestOutput] = []

    def add(self, seq: Sequence) -> None:
        """A new request (its id is not in use): registered and queued."""
        self.requests[seq.request_id] = seq
        self.queue(seq)

    def queue(self, seq: Sequence) -> None:
        """Into the waiting queue: on arrival, or preempted."""
        seq.status = SequenceStatus.WAITING
        self.waiting.push(seq)
        self.num_waiting += 1

    def seat(self, seq: Sequence, cached: int) -> None:
        """A waiting request, taken off the queue, joins the running set; the KV of its
        first `cached` tokens came from the prefix cache."""
        self.num_waiting -= 1
        self._run(seq, cached)

    def _run(self, seq: Sequence, cached: int) -> None:
        """Into the running set, the KV of its first `cached` tokens in place (read from
        another engine or not, its kv_source is spent: a preempted request recomputes)."""
        seq.num_computed_tokens, seq.kv_source = cached, None
        if not seq.first_scheduled:
            seq.first_scheduled, seq.num_cached_tokens = True, cached
        seq.status = SequenceStatus.RUNNING
        seq.seated_step = self.step
        self.order.seat(seq)
        bisect.insort(self.running, seq, key=Sequence.sort_key)

    def preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the KV (prefix-cached blocks stay reusable). A prefill
        whose early handle is out ends instead: its reader recomputes what it cannot read
        (counted all the same: its seat was taken)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        if seq.handed_on:
            self.finish(seq, "abort")
            return
        self.leave_running(seq)
        seq.num_computed_tokens = 0
        seq.evicted_step = self.step
        seq.num_preemptions += 1
        self.queue(seq)

    def load(self, seq: Sequence, cached: int) -> None:
        """A waiting request whose blocks are allocated and whose KV past its first
        `cached` tokens (a local prefix hit) is read from another engine."""
        assert self.kv is not None
        self.num_waiting -= 1
        seq.status, seq.num_computed_tokens = SequenceStatus.LOADING, cached
        self.kv.start_load(seq, cached // self.allocator.block_size)
        self.loading.append(seq)

    def loaded(self) -> None:
        """Seats the requests whose reads are done: from the arrived tokens, or from the
        local prefix when the read failed (the rest is computed here). One ended meanwhile
        gives its blocks back now that nothing writes into them."""
        if self.kv is None or not self.loading:
            return
        for seq, read in self.kv.finished():
            self.loading.remove(seq)
            if seq.status is SequenceStatus.FINISHED:
                self.leave_running(seq)
            else:
                self._run(seq, read or seq.num_computed_tokens)

    def hold_early(self, seq: Sequence) -> None:
        """A prefill for another engine, just seated with blocks for its whole prompt, hands
        its KV on now (when the connector gives early handles): its output ends it for
        the router, and the reader reads each layer as this engine computes it."""
        handle = None if self.kv is None else self.kv.hold_early(seq)
        if handle is not None:  # positional, in RequestOutput's field order
            seq.handed_on = True
            self._aborted.append(RequestOutput(seq.request_id, [], [], True, "length", seq.num_prompt_tokens,
                                               seq.num_cached_tokens, 0, None, None, handle))

    def release(self, request_id: str) -> bool:
        """The KV an ended request holds for a transfer, given back (its reader is done)."""
        blocks = None if self.kv is None else self.kv.release(request_id)
        if blocks is not None:
            self.allocator.free_blocks(blocks)
        return blocks is not None

    def expire(self) -> None:
        """Holds whose lease ran out give their blocks back (leases run on the clock)."""
        if self.kv is not None and self.kv.held:
            for blocks in self.kv.expired(time.monotonic()):
                self.allocator.free_blocks(blocks)

    def leave_running(self, seq: Sequence, hold: bool = False) -> None:
        """The one exit from the running set: blocks back to the pool, adapter slot unpinned
        (also frees the blocks of a waiting request whose admission failed). With `hold`
        (it ends for a transfer) the blocks of its computed tokens stay, held by the KV
        connector, and its output names them."""
        if seq.status is SequenceStatus.RUNNING:
            self.order.unseat(seq)
        if hold and self.kv is not None:
            seq.kv_handle = self.kv.hold(seq)
        elif seq.handed_on and self.kv is not None:
            self.kv.drop(seq)  # an early hold's lease ends before its blocks can be reused
        self.allocator.free(seq)
        if seq.lora_slot is not None and seq.adapter is not None:
            self.lora().release(seq.adapter)
            seq.lora_slot = None
        if self.speculator is not None:
            self.speculator.proposer.release(seq)

    def finish(self, seq: Sequence, reason: str, hold: bool = False) -> None:
        """`seq` is finished for `reason`; a running one stays in `running` until
        `drop_finished` (one pass per step's results, not a removal per request). With
        `hold`, or a prefill for another engine ending by length, its KV is kept for a
        transfer."""
        if seq.status is SequenceStatus.RUNNING:
            self.leave_running(seq, hold or (seq.kv_hold and reason == "length"))
        elif seq.status is SequenceStatus.WAITING:  # (or preempted while its last token was in
            self.num_waiting -= 1  # flight): its heap entry is skipped lazily
        # LOADING: its blocks are given back when its read is done (`loaded`)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self.requests[seq.request_id]

    def drop_finished(self) -> None:
        """Takes the requests `finish` ended out of `running`."""
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

    def end(self, seq: Sequence, reason: str, error: str | None = None, hold: bool = False) -> None:
        """Finish a request outside a step's results, wherever it is: an abort, or the
        engine ending it (`error` says why). Its blocks are free when this returns (held
        for a transfer with `hold`; a loading one's once its read is done), and the next
        `take_aborted` reports it (not one whose early handle was its last output)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.finish(seq, reason, hold)
        if seq.handed_on:
            return  # its output ended with its early handle
        out = request_output(seq, [], [])
        out.error = error
        self._aborted.append(out)

    def take_aborted(self) -> list[RequestOutput]:
        out, self._aborted = self._aborted, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or bool(self.loading)

    def block_tables(self) -> list[list[int]]:
        """Every block table that references blocks: running, loading and held ones."""
        tables = [s.block_table for s in self.running] + [s.block_table for s in self.loading]
        if self.kv is not None:
            tables += self.kv.held_tables()
        return tables

    def lora(self) -> LoraManager:
        """The adapter manager: only requests for an adapter reach it, and the engine
        refuses those when it serves no adapters."""
        if self.adapters is None:
            raise RuntimeError("a request for an adapter reached a scheduler without adapters")
        return self.adapters


def request_output(seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
    """What `seq` reports now: `tokens` new (and their `logprobs`), finished or not."""
    # positional, in RequestOutput's field order: this runs for every token of a step
    return RequestOutput(seq.request_id, tokens, logprobs, seq.status is SequenceStatus.FINISHED,
                         seq.finish_reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                         len(seq.token_ids) - seq.num_prompt_tokens, None, None, seq.kv_handle)
