"""Bookkeeping: a step's sampled tokens applied to the requests that planned them.

`Bookkeeping.update` appends each pick (and the guesses the picks confirm, `_kept`),
caches the blocks the step filled, adds scored prompt tokens (`score_prompts`) and
finishes the requests that end (`_ends`: a stop token, their length, a complete grammar).
It never plans: that is `Scheduler.schedule`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.lifecycle import Lifecycle, request_output
from omnibus.engine.core.plan import ScheduledSeq, SchedulerOutput
from omnibus.engine.core.sequence import RequestOutput, SamplerOutput, Sequence, SequenceStatus, TokenLogprobs

if TYPE_CHECKING:
    from omnibus.engine.spec import Speculator


class Bookkeeping:
    """Applies step results for the scheduler, through its `Lifecycle`."""

    def __init__(self, lifecycle: Lifecycle, allocator: BlockAllocator,
                 speculator: Speculator | None = None) -> None:
        self._life = lifecycle
        self._allocator = allocator
        self._speculator = speculator

    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> list[RequestOutput]:
        """Apply a step's sampled tokens; return one output per request that produced a
        token or finished by it (aborts are reported by `take_aborted`; a request whose
        early handle went out reports nothing more). A sequence preempted
        after the step was launched still gets its token: it was computed from its whole
        context, and recomputing the prefix later reproduces the same KV."""
        results: list[RequestOutput] = []
        row = 0
        finished = False
        running, done = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        # A block fills up once every block_size tokens: only then is it worth a call.
        bs = self._allocator.block_size if self._allocator.enable_prefix_caching else 1 << 62
        if sampled is not None and sampled.prompt_logprobs:
            score_prompts(sampled.prompt_logprobs)
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
                self._allocator.cache_blocks(seq)  # blocks this step filled
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
                self._life.finish(seq, reason)
            if seq.handed_on:
                continue  # its output ended with its early handle (the reader samples this token itself)
            lps = [lp for lp in picked_logprobs[first:first + emitted] if lp is not None]
            result = request_output(seq, tokens[len(tokens) - emitted:], lps)
            if seq.prompt_logprobs is not None:  # its first token: the prompt is scored
                result.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            results.append(result)
        if finished:
            self._life.drop_finished()
        return results

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

    def _kept(self, item: ScheduledSeq, picks: list[int]) -> list[int]:
        """The tokens a speculating decode emits: the guesses the target's picks confirm,
        then the target's pick after them. The KV of the rest was computed for guesses
        that were wrong: it is dropped (and its blocks freed) at once."""
        seq = item.seq
        kept = self._spec().verified(item.guess, picks)
        if seq.status is SequenceStatus.RUNNING:
            seq.num_computed_tokens -= len(item.guess) - kept
            self._allocator.trim(seq, seq.num_computed_tokens)
        return picks[:kept + 1]

    def _spec(self) -> Speculator:
        """The speculator: only its own guesses reach it."""
        if self._speculator is None:
            raise RuntimeError("a guessed token reached a scheduler without a speculator")
        return self._speculator


def score_prompts(computed: dict[Sequence, tuple[int, list[TokenLogprobs]]]) -> None:
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
