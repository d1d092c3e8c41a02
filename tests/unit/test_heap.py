"""Servers freeze their heap once started: garbage made before is collected, not kept."""

import gc
import weakref

from omnibus.common.heap import freeze_heap


class _Node:
    pass


def test_freeze_heap_collects_the_garbage_before_freezing_the_rest():
    cycle = _Node()
    cycle.me = cycle
    dead = weakref.ref(cycle)
    del cycle
    kept = _Node()
    try:
        freeze_heap()
        assert dead() is None  # the unreachable cycle was collected first
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # frozen: out of the collector's walk
    finally:
        gc.unfreeze()
