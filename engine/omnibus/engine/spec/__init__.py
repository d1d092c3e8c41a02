"""Speculative decoding: proposers guess a sequence's next tokens, the target model
scores every guess in the same step (core/scheduler.py plans them, worker/model_runner.py
runs them), and the scheduler keeps the longest prefix the target model itself samples.

A proposer is one small interface (`Proposer.propose`); each guesses deterministically
(the n-gram match, or a draft model's greedy tokens), so checking a guess against the
target's own sample at that position, drawn with that position's noise, is the
rejection rule of Leviathan et al. for a one-hot proposal: a guess x is kept with
probability p(x), and on a miss the emitted token is distributed as p without x. The
output is the target's distribution, token for token the non-speculative output for
greedy and seeded requests.
"""

from omnibus.engine.spec.proposer import Proposer, SpecConfig, SpecStats, Speculator

__all__ = ["Proposer", "SpecConfig", "SpecStats", "Speculator"]
