"""Speculative decoding without a model: the n-gram proposer, guesses planned in the
step budget and the free blocks (never by preempting), kept guesses and the freed slots
of rejected ones, and speculation turning itself off above its batch size. The simulator
(test_scheduler_sim.py) runs speculation under every other feature."""

from __future__ import annotations

import pytest

from omnibus.engine.core.block_allocator import BlockAllocator
from omnibus.engine.core.policies import make_policy
from omnibus.engine.core.scheduler import Scheduler, SchedulerConfig
from omnibus.engine.core.sequence import SamplerOutput, Sequence
from omnibus.engine.spec import SpecConfig, Speculator
from omnibus.engine.spec.proposer import NgramProposer
from omnibus.engine.worker.sampling import SamplingParams


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # the last 2 tokens seen before: what followed them
    ([1, 2, 9, 1, 2, 7, 1, 2], 3, [7, 1, 2]),  # the latest earlier match
    ([1, 2, 3, 1, 2], 9, [3, 1, 2]),  # at most what the sequence holds
    ([1, 2, 3, 4, 5], 2, []),  # no match
    ([7, 7], 2, []),  # shorter than min_n + 1
])
def test_ngram_proposer_predicts_what_followed_the_latest_match(tokens, k, expected):
    assert NgramProposer(max_n=3, min_n=2).lookup(tokens, k) == expected


def test_ngram_matches_are_token_aligned():
    # int32 bytes of [256, 0] are 00 01 00 00 00 00 00 00: token 1's bytes 01 00 00 00 sit at
    # an unaligned offset inside them, which is not a match of token 1
    assert NgramProposer(max_n=1, min_n=1).lookup([5, 256, 0, 9, 1], 2) == []
    assert NgramProposer(max_n=1, min_n=1).lookup([5, 1, 6, 256, 0, 9, 1], 2) == [6, 256]


def test_longer_matches_win_over_shorter_ones():
    # last 3 tokens (4 5 6) occur at the start; the last 1 (6) also occurs later
    assert NgramProposer(max_n=3, min_n=1).lookup([4, 5, 6, 8, 6, 9, 4, 5, 6], 1) == [8]


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="bogus"), "speculative must be one of ngram, draft, got 'bogus'"),
    (dict(method="draft"), "speculative-draft-model is needed by, and only by, --speculative draft"),
    (dict(method="ngram", draft_model="d"), "speculative-draft-model is needed by"),
    (dict(method="ngram", num_tokens=0), r"num-speculative-tokens must be in \[1, 16\], got 0"),
    (dict(method="ngram", max_batch=0), "speculative-max-batch must be >= 1, got 0"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_min <= ngram_max"),
])
def test_spec_config_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kwargs)


class FixedProposer:
    name = "fixed"

    def __init__(self, guess: list[int]) -> None:
        self.guess = guess

    def propose(self, seqs, k):
        return [self.guess[:n] for n in k]

    def release(self, seq):
        pass

    def check_integrity(self):
        pass


def make(num_blocks=32, block_size=4, max_seqs=4, budget=64, guess=(5, 6, 7), max_batch=8):
    spec = Speculator(SpecConfig("ngram", num_tokens=3, max_batch=max_batch), FixedProposer(list(guess)))
    sched = Scheduler(SchedulerConfig(max_seqs, budget, 256), BlockAllocator(num_blocks, block_size),
                      make_policy("continuous"), (2,), None, spec)
    return sched, spec


def seq(rid, prompt, max_tokens=20) -> Sequence:
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def step(s: Scheduler, picks_for):
    """One step whose model picks `picks_for(seq, j)` at row j of each sampling item."""
    plan = s.schedule()
    rows = [picks_for(i.seq, j) for i in plan.scheduled if i.samples for j in range(len(i.guess) + 1)]
    outs = s.update(plan, SamplerOutput(rows, [None] * len(rows)))
    s.allocator.check_integrity(s.block_tables())
    return plan, outs


def test_kept_guesses_are_emitted_and_rejected_slots_freed_the_same_step():
    s, spec = make()
    s.add(seq("a", [10, 11, 12]))  # 3 tokens: 1 block of 4
    step(s, lambda seq, j: 4)  # prefill: picks 4
    # guesses 5 6 7 scored at positions 3..6 (a second block); the model confirms 5, then picks 9
    plan, outs = step(s, lambda seq, j: [5, 9, 1, 1][j])
    assert [(i.num_tokens, i.guess) for i in plan.scheduled] == [(4, [5, 6, 7])]
    assert outs[0].new_token_ids == [5, 9]
    a = s.requests["a"]
    assert a.token_ids == [10, 11, 12, 4, 5, 9] and a.num_computed_tokens == 5
    assert len(a.block_table) == 2  # positions 0..4 computed: blocks for 5 tokens
    assert (spec.stats.proposed, spec.stats.accepted, spec.stats.emitted, spec.stats.steps) == (3, 1, 2, 1)
    # all rejected: the slots of positions 6..8 go; only the target's own pick is emitted
    plan, outs = step(s, lambda seq, j: 8)
    assert outs[0].new_token_ids == [8] and s.requests["a"].num_computed_tokens == 6


def test_guesses_never_preempt_and_fit_the_free_blocks_or_go():
    s, _ = make(num_blocks=3, block_size=4, max_seqs=2)  # 2 usable blocks
    s.add(seq("a", [10, 11, 12]))
    s.add(seq("b", [20, 21, 22]))
    step(s, lambda seq, j: 4)  # both prefilled: a block each, the pool is full
    plan, _ = step(s, lambda seq, j: 4)  # position 3 fits each block; guesses would need more
    assert plan.preempted == [] and [i.guess for i in plan.scheduled] == [[], []]


def test_guesses_take_what_the_step_budget_leaves():
    s, _ = make(budget=6)
    s.add(seq("a", [10, 11, 12]))
    s.add(seq("b", [20, 21, 22]))
    step(s, lambda seq, j: 4)
    plan, _ = step(s, lambda seq, j: 1)
    assert [(i.seq.request_id, i.num_tokens) for i in plan.scheduled] == [("a", 4), ("b", 2)]
    assert plan.num_batched_tokens == 6


def test_speculation_turns_itself_off_above_its_batch_size_and_per_request():
    s, _ = make(max_batch=1)
    s.add(seq("a", [10, 11, 12]))
    step(s, lambda seq, j: 4)
    plan, _ = step(s, lambda seq, j: 1)
    assert plan.scheduled[0].guess == [5, 6, 7]  # alone: it speculates
    s.add(seq("b", [20, 21, 22]))
    step(s, lambda seq, j: 1)
    plan, _ = step(s, lambda seq, j: 1)
    assert [i.guess for i in plan.scheduled] == [[], []]  # two running: above max_batch
    s2, _ = make()
    off = Sequence("c", [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0, speculative_off=True))
    s2.add(off)
    step(s2, lambda seq, j: 4)
    plan, _ = step(s2, lambda seq, j: 1)
    assert plan.scheduled[0].guess == []


def test_guesses_stop_at_max_tokens_and_at_a_stop_token():
    s, _ = make()
    s.add(seq("a", [10, 11, 12], max_tokens=3))
    step(s, lambda seq, j: 4)
    plan, outs = step(s, lambda seq, j: [5, 6, 7][j])
    assert plan.scheduled[0].guess == [5]  # room for 2 more outputs: 1 guess + the pick
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "length"
    s, _ = make()
    stop = Sequence("b", [10, 11, 12], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=(6,)))
    s.add(stop)
    step(s, lambda seq, j: 4)
    plan, outs = step(s, lambda seq, j: [5, 6, 7, 1][j])  # confirms 5 and 6; 6 ends it
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "stop"
    assert s.allocator.check_integrity([]).referenced == 0
