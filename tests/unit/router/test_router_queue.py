"""The router's priority queue: order, FIFO ties, aging, removal and its counters."""

from __future__ import annotations

import pytest

from omnibus.router.dispatch.queue import RequestQueue


def drain(q: RequestQueue[str]) -> list[str]:
    return [q.pop() for _ in range(len(q))]


def test_higher_priority_first_and_fifo_within_a_priority():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    for i, (name, prio) in enumerate([("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)]):
        q.push(name, prio, cost=1, arrival=float(i))
    assert drain(q) == ["b", "d", "a", "c", "e"]


def test_aging_lets_an_old_low_priority_request_overtake():
    q: RequestQueue[str] = RequestQueue(aging_seconds=10.0)
    q.push("old-low", 0, cost=1, arrival=0.0)
    # Arriving 25 s after old-low costs 2.5 levels: 2 - 2.5 ranks below old-low's 0.
    q.push("late-high", 2, cost=1, arrival=25.0)
    # Arriving 15 s after costs 1.5 levels: 2 - 1.5 still ranks above old-low.
    q.push("early-high", 2, cost=1, arrival=15.0)
    assert drain(q) == ["early-high", "old-low", "late-high"]


def test_aging_does_not_reorder_within_the_margin():
    q: RequestQueue[str] = RequestQueue(aging_seconds=10.0)
    q.push("low", 0, cost=1, arrival=0.0)
    q.push("high", 1, cost=1, arrival=9.0)  # low has aged 0.9 levels: not enough
    assert drain(q) == ["high", "low"]


def test_remove_updates_counts_and_skips_the_item():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    q.push("a", 1, cost=10, arrival=0.0)
    q.push("b", 1, cost=20, arrival=1.0)
    q.push("c", 3, cost=5, arrival=2.0)
    assert (len(q), q.tokens, q.count_by_priority()) == (3, 35, {1: 2, 3: 1})
    assert q.remove("c") is True
    assert q.remove("c") is False
    assert (len(q), q.tokens, q.count_by_priority()) == (2, 30, {1: 2})
    assert drain(q) == ["a", "b"]
    assert (len(q), q.tokens, q.count_by_priority()) == (0, 0, {})
    with pytest.raises(IndexError):
        q.pop()


def test_pushing_the_same_item_twice_is_refused():
    q: RequestQueue[str] = RequestQueue(aging_seconds=0)
    q.push("a", 0, cost=1, arrival=0.0)
    with pytest.raises(ValueError, match="already queued"):
        q.push("a", 0, cost=1, arrival=0.0)


def test_many_removals_do_not_pile_up_dead_slots():
    q: RequestQueue[list[int]] = RequestQueue(aging_seconds=0)
    items = [[i] for i in range(1000)]  # distinct objects: the queue tracks identity
    for i, item in enumerate(items):
        q.push(item, priority=i % 3, cost=1, arrival=float(i))
    for item in items[::2]:
        assert q.remove(item)
    assert len(q._heaps[""]) <= 2 * len(q) + 64  # noqa: SLF001 - the point of the test
    expected = sorted(items[1::2], key=lambda item: (-(item[0] % 3), item[0]))
    assert [q.pop() for _ in range(len(q))] == expected
