"""Batching strategies as admission policies of the one scheduler.

The scheduler asks its policy two things: how many waiting requests may join now
(`admission_limit`), and how many tokens of KV to reserve for a request when it
joins (`reserve_tokens`). Everything else (the model runner, the KV pool, chunked
prefill inside a step) is shared, so the strategies differ only where they differ
in the literature:

| policy     | a batch starts when                               | joins a running batch | KV reserved at admission |
|------------|---------------------------------------------------|-----------------------|--------------------------|
| continuous | every step, while there is room                   | yes                   | as tokens arrive         |
| dynamic    | max_batch_size waiting, or window after the first | no                    | prompt + max_tokens      |
| static     | max_batch_size waiting (or optional timeout)      | no                    | prompt + max_tokens      |
| none       | one request, when the engine is idle              | no                    | prompt + max_tokens      |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omnibus.engine.core.sequence import Sequence

UNLIMITED = 1 << 30


class BatchingPolicy:
    name = "base"
    forms_batches = False  # True: a batch holds its slots until its last request finishes

    def admission_limit(self, now: float, num_running: int, num_waiting: int,
                        oldest_arrival: Callable[[], float | None]) -> int:
        """How many waiting requests may be admitted at this step."""
        raise NotImplementedError

    def reserve_tokens(self, seq: Sequence) -> int:
        """Tokens of KV to allocate when `seq` is admitted (0: only what the step needs)."""
        return 0

    def admitted(self, limit: int, count: int) -> None:
        """The scheduler admitted `count` of the `limit` (> 0) requests allowed this step."""

    def close_arrivals(self, closed: bool = True) -> None:
        """No request will arrive until reopened (offline generate): no batch waits for more."""


class ContinuousPolicy(BatchingPolicy):
    """Iteration-level batching: requests join and leave at every step."""

    name = "continuous"

    def admission_limit(self, now: float, num_running: int, num_waiting: int,
                        oldest_arrival: Callable[[], float | None]) -> int:
        return UNLIMITED


@dataclass
class FormedBatchPolicy(BatchingPolicy):
    """Static and dynamic batching: a batch forms while the engine is idle, then runs
    until its last request finishes. `window_s` None means wait for a full batch."""

    max_batch_size: int
    window_s: float | None
    name: str = "static"
    forms_batches = True
    # Members of the last batch formed that did not fit the KV pool: they run as the next
    # batch, however few (a static batch left waiting for more would wait on a free pool).
    owed: int = 0
    arrivals_closed: bool = False

    def admission_limit(self, now: float, num_running: int, num_waiting: int,
                        oldest_arrival: Callable[[], float | None]) -> int:
        if num_running or not num_waiting:
            return 0
        if self.owed:  # the rest of the last batch, before (and not topped up by) later ones
            return min(self.owed, num_waiting)
        if num_waiting >= self.max_batch_size:
            return self.max_batch_size
        if self.arrivals_closed:
            return num_waiting
        first = oldest_arrival()
        if self.window_s is not None and first is not None and now - first >= self.window_s:
            return num_waiting  # the window expired: run the partial batch
        return 0

    def admitted(self, limit: int, count: int) -> None:
        self.owed = limit - count

    def close_arrivals(self, closed: bool = True) -> None:
        self.arrivals_closed = closed

    def reserve_tokens(self, seq: Sequence) -> int:
        # Servers built on request-level batching size KV for the worst case up front: every
        # token but the last sampled one, whose KV is never computed.
        return seq.num_prompt_tokens + seq.params.max_tokens - 1


class NoBatchingPolicy(FormedBatchPolicy):
    """One request at a time."""

    def __init__(self) -> None:
        super().__init__(max_batch_size=1, window_s=0.0, name="none")


def make_policy(name: str, max_batch_size: int = 32, window_ms: float | None = None) -> BatchingPolicy:
    """`max_batch_size` at most the engine's max_num_seqs: a formed batch runs all at once."""
    if name == "continuous":
        return ContinuousPolicy()
    if name == "dynamic":
        return FormedBatchPolicy(max_batch_size, (10.0 if window_ms is None else window_ms) / 1000, "dynamic")
    if name == "static":
        return FormedBatchPolicy(max_batch_size, None if window_ms is None else window_ms / 1000, "static")
    if name == "none":
        return NoBatchingPolicy()
    raise ValueError(f"unknown batching policy {name!r}; choose continuous, dynamic, static or none")
