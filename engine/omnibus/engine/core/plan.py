"""One step's plan, the scheduler's output to the model runner: which sequences run and
which of their tokens are computed (`SchedulerOutput`, one `ScheduledSeq` each).

`plan_chunk` makes each entry, for a running sequence's next chunk (Scheduler) and for a
request just seated (Admission) alike.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from omnibus.engine.core.block_allocator import KvCopy
from omnibus.engine.core.sequence import Sequence


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
    # KV copies between the device pool and the host tier (block_allocator.KvCopy), made
    # in order before the step's forward
    kv_copies: Seq[KvCopy] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def plan_chunk(seq: Sequence, n: int, step: int, guess: list[int] | None = None) -> ScheduledSeq:
    """The next `n` tokens of `seq` (and the decode's `guess`, if any), planned in `step`."""
    seq.scheduled_step = step
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
