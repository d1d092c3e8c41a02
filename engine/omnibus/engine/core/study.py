"""Counters for the batching-strategies study (bench/omnibus/bench/strategies.py), collected by an
observer the scheduler calls once per planned step. Only an engine started with
--study-counters has one: serving without a study pays nothing for them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from omnibus.engine.core.sequence import Sequence


class StepObserver(Protocol):
    def on_step(self, num_tokens: int, slots: int, running: Iterable[Sequence], block_size: int) -> None:
        """One planned step that computes `num_tokens` tokens with `slots` batch slots
        held; `running` already counts this step's tokens as computed."""


@dataclass
class StudyCounters:
    """Cumulative counts over the steps that computed something."""

    steps: int = 0
    slots_stepped: int = 0  # batch slots held per step (formed batches keep finished slots)
    useful_tokens: int = 0  # tokens computed (prompt chunks + decodes)
    kv_tokens_stored: int = 0  # KV entries holding real tokens, summed over steps
    kv_tokens_reserved: int = 0  # KV slots allocated to running sequences, summed over steps

    def on_step(self, num_tokens: int, slots: int, running: Iterable[Sequence], block_size: int) -> None:
        self.steps += 1
        self.slots_stepped += slots
        self.useful_tokens += num_tokens
        for seq in running:  # O(running): why this runs only when a study asks for it
            self.kv_tokens_stored += seq.num_computed_tokens
            self.kv_tokens_reserved += len(seq.block_table) * block_size
