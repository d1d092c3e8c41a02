"""A dynamic batcher with the knobs of Triton's: max batch size, max queue delay,
preferred batch sizes, priority levels, a queue cap and per-request queue timeouts.

Requests (each with one or more items) wait in priority order (higher first, then
FIFO). A batch is sent when the queued items reach a preferred size or the max
size, or when the oldest request has waited `max_queue_delay_ms`; then it takes the
largest preferred size that the queue can fill (else everything up to the max).
A request is never split across batches. One asyncio task owns the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class QueueFullError(Exception):
    """The queue is at its cap (RESOURCE_EXHAUSTED)."""


class QueueTimeoutError(Exception):
    """The request waited in the queue past its timeout (DEADLINE_EXCEEDED)."""


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 32  # items per batch
    max_queue_delay_ms: float = 5.0  # how long the oldest request may wait for a fuller batch
    preferred_batch_sizes: tuple[int, ...] = ()  # sizes worth sending at once
    max_queue_size: int = 1024  # queued requests at most; more are refused
    default_timeout_ms: float | None = None  # queue timeout when a request names none

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_queue_delay_ms < math.inf:  # NaN or inf: a partial batch would never go
            raise ValueError(f"max_queue_delay_ms must be finite and >= 0, got {self.max_queue_delay_ms}")
        if any(not 1 <= s <= self.max_batch_size for s in self.preferred_batch_sizes):
            raise ValueError(f"preferred_batch_sizes must lie in [1, max_batch_size], got {self.preferred_batch_sizes}")
        if self.max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1, got {self.max_queue_size}")
        if self.default_timeout_ms is not None and not 0 < self.default_timeout_ms < math.inf:
            raise ValueError(f"default_timeout_ms must be finite and > 0, got {self.default_timeout_ms}")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[int, int]
    items: Sequence[T] = field(compare=False)
    enqueued: float = field(compare=False)
    future: asyncio.Future = field(compare=False)
    timer: asyncio.TimerHandle | None = field(default=None, compare=False)  # its queue timeout


class DynamicBatcher(Generic[T, R]):
    """`await submit(items)` returns `run(batch)`'s results for those items, where `run`
    receives the items of every request in the batch, concatenated."""

    def __init__(self, config: BatcherConfig, run: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self.config = config
        self._run = run
        self._heap: list[_Entry[T]] = []
        self._count = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # sizes of the batches sent, for tests and metrics

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def close(self) -> None:
        """Stop the queue task from any thread."""
        if self._task is not None and not self._task.done():
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)

    @property
    def queued_items(self) -> int:
        return sum(len(e.items) for e in self._heap if not e.future.done())

    async def submit(self, items: Sequence[T], priority: int = 0, timeout_ms: float | None = None) -> list[R]:
        live = [e for e in self._heap if not e.future.done()]
        if len(live) >= self.config.max_queue_size:
            raise QueueFullError(f"queue full ({self.config.max_queue_size} requests waiting); retry later")
        now = time.monotonic()
        timeout = timeout_ms if timeout_ms is not None else self.config.default_timeout_ms
        loop = asyncio.get_running_loop()
        entry = _Entry((-priority, next(self._count)), list(items), now, loop.create_future())
        if timeout is not None:  # on time even while a batch runs (the loop awaits it then)
            entry.timer = loop.call_later(timeout / 1000, self._time_out, entry)
        heapq.heappush(self._heap, entry)
        self._wake.set()
        return await entry.future

    def _time_out(self, entry: _Entry[T]) -> None:
        """A queued request's timeout: it fails now; the loop drops its entry lazily."""
        if not entry.future.done():
            entry.future.set_exception(QueueTimeoutError(
                f"waited {1000 * (time.monotonic() - entry.enqueued):.0f} ms in the queue, past its timeout"))
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._drop_done()
            if not self._heap:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._form(time.monotonic())
            if batch is None:
                self._wake.clear()
                # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel
                # (stop()) that arrives when the wake-up has just happened.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._sleep_for(time.monotonic())):
                        await self._wake.wait()
                continue
            await self._execute(batch)

    def _drop_done(self) -> None:
        """Forget the requests that timed out or were cancelled while queued."""
        kept = [e for e in self._heap if not e.future.done()]
        if len(kept) != len(self._heap):
            self._heap = kept
            heapq.heapify(self._heap)

    def _form(self, now: float) -> list[_Entry[T]] | None:
        """The next batch to send, or None to keep waiting."""
        ordered = sorted(self._heap)
        sizes = list(itertools.accumulate(len(e.items) for e in ordered))  # strictly increasing
        cap = self.config.max_batch_size
        fits = [s for s in sizes if s <= cap]
        preferred = [s for s in fits if s in self.config.preferred_batch_sizes]
        expired = (now - min(e.enqueued for e in ordered)) * 1000 >= self.config.max_queue_delay_ms
        if preferred:  # the largest preferred size the queue fills, whatever else waits
            n = sizes.index(preferred[-1]) + 1
        elif sizes[-1] >= cap or expired:
            n = max(len(fits), 1)  # as full as allowed; an oversized request goes alone
        else:
            return None
        batch = ordered[:n]
        self._heap = ordered[n:]  # a sorted list is a valid heap
        for e in batch:  # out of the queue: its queue timeout no longer applies
            if e.timer is not None:
                e.timer.cancel()
        return batch

    def _sleep_for(self, now: float) -> float:
        oldest = min(e.enqueued for e in self._heap)
        return max(0.0, oldest + self.config.max_queue_delay_ms / 1000 - now)

    async def _execute(self, batch: list[_Entry[T]]) -> None:
        batch = [e for e in batch if not e.future.done()]  # cancelled while queued
        if not batch:
            return
        items = [item for e in batch for item in e.items]
        self.batch_sizes.append(len(items))
        try:
            results = await self._run(items)
        except Exception as exc:  # every waiter learns why, the loop lives on
            if len(batch) > 1:  # perhaps one request's bad input: each runs alone, so each
                for e in batch:  # gets its own answer (and a bad one its own error)
                    await self._execute([e])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        start = 0
        for e in batch:
            if not e.future.done():
                e.future.set_result(results[start:start + len(e.items)])
            start += len(e.items)
