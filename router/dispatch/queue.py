"""The router's waiting room: requests that no engine has room for yet.

Highest priority first, first come first served within a priority, with aging: a
request that has waited `aging_seconds` ranks as if its priority were one higher, so
low priority is delayed but never starved. Because every waiting request ages at the
same rate, the ranking key `priority - arrival / aging_seconds` is fixed when the
request enters and a plain heap keeps the order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class _Entry(Generic[T]):
    item: T
    priority: int
    cost: int  # tokens, for the queued-tokens cap
    removed: bool = field(default=False)


class RequestQueue(Generic[T]):
    """A priority queue with aging, O(log n) push/pop and O(1) removal (lazy).

    Items are tracked by identity: each object may be queued once. Not thread-safe:
    one asyncio loop owns it.
    """

    def __init__(self, aging_seconds: float) -> None:
        if aging_seconds < 0:
            raise ValueError(f"aging_seconds must be >= 0, got {aging_seconds}")
        self._aging = aging_seconds
        self._heap: list[tuple[float, int, _Entry[T]]] = []
        self._entries: dict[int, _Entry[T]] = {}  # id(item) -> entry, for remove()
        self._order = itertools.count()  # FIFO tie-break
        self._tokens = 0
        self._by_priority: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Sum of the costs of the queued items."""
        return self._tokens

    def count_by_priority(self) -> dict[int, int]:
        """Queued items per priority (priorities with none are left out). Safe to call
        from another thread (the metrics endpoint): list() copies the items atomically."""
        return {p: n for p, n in list(self._by_priority.items()) if n}

    def push(self, item: T, priority: int, cost: int, arrival: float) -> None:
        """Queues `item`; `arrival` is a monotonic timestamp in seconds."""
        if id(item) in self._entries:
            raise ValueError("item is already queued")
        rank = priority - arrival / self._aging if self._aging else float(priority)
        entry = _Entry(item, priority, cost)
        heapq.heappush(self._heap, (-rank, next(self._order), entry))
        self._entries[id(item)] = entry
        self._tokens += cost
        self._by_priority[priority] += 1

    def pop(self) -> T:
        """Removes and returns the highest-ranked item. Raises IndexError when empty."""
        self._drop_removed()
        if not self._heap:
            raise IndexError("pop from an empty RequestQueue")
        entry = heapq.heappop(self._heap)[2]
        self._forget(entry)
        return entry.item

    def remove(self, item: T) -> bool:
        """Takes `item` out wherever it is; False if it was not queued."""
        entry = self._entries.get(id(item))
        if entry is None:
            return False
        entry.removed = True  # its heap slot is skipped when it surfaces
        self._forget(entry)
        if len(self._heap) > 2 * len(self._entries) + 64:
            # Mostly dead slots (a burst of cancels): rebuild rather than let them pile up.
            self._heap = [slot for slot in self._heap if not slot[2].removed]
            heapq.heapify(self._heap)
        return True

    def _forget(self, entry: _Entry[T]) -> None:
        del self._entries[id(entry.item)]
        self._tokens -= entry.cost
        self._by_priority[entry.priority] -= 1

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2].removed:
            heapq.heappop(self._heap)
