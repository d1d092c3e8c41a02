"""Reading KV held by an engine of another tensor-parallel size (kv_transfer/reshard.py):
the layout a handle names parses back, which layouts a reader can reshard, and the plan
each reader rank follows puts every one of its heads where a reader of its own size
would hold it, for every split tensor parallelism allows (replicated heads included).
The reads themselves, served engines of two ranks and one: tests/e2e/test_tensor_parallel_serving.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from omnibus.engine.kv_transfer.connector import pool_layout
from omnibus.engine.kv_transfer.reshard import Layout, reshard_plan, reshardable, splits
from omnibus.engine.parallel.shard import kv_head_range


def test_a_pool_layout_parses_back():
    caches = [(torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16),) * 2 for _ in range(3)]
    assert Layout.parse(pool_layout(caches)) == Layout(3, (16, 2, 64), "bfloat16", 1)
    assert Layout.parse(pool_layout(caches, 4)) == Layout(3, (16, 2, 64), "bfloat16", 4)
    for bad in ("", "3x16x2:float32", "axbxcxd:float32", "3x16x2x64", "3x16x2x64:float32/tpx", "0x16x2x64:f/tp2"):
        assert Layout.parse(bad) is None, bad


def test_only_another_rank_count_of_the_same_pool_is_reshardable():
    one = Layout(2, (8, 4, 32), "float32", 1)
    two = Layout(2, (8, 2, 32), "float32", 2)
    assert reshardable(two, one, 4) and reshardable(one, two, 4)
    assert not reshardable(one, one, 4)  # the same rank count reads as it is
    assert not reshardable(Layout(2, (8, 4, 32), "float32", 2), one, 4)  # two ranks each holding all 4 heads
    assert not reshardable(Layout(3, (8, 2, 32), "float32", 2), one, 4)  # layers
    assert not reshardable(Layout(2, (16, 2, 32), "float32", 2), one, 4)  # block tokens
    assert not reshardable(Layout(2, (8, 2, 64), "float32", 2), one, 4)  # head size
    assert not reshardable(Layout(2, (8, 2, 32), "bfloat16", 2), one, 4)  # dtype
    assert not reshardable(Layout(2, (8, 1, 32), "float32", 3), one, 4)  # 4 heads do not split over 3
    assert reshardable(Layout(2, (8, 1, 32), "float32", 8), one, 4)  # 8 ranks replicate 4 heads


SPLITS = [(h, n) for h in (1, 2, 3, 4, 8) for n in (1, 2, 3, 4, 8) if splits(h, n)]


@pytest.mark.parametrize("heads", sorted({h for h, _ in SPLITS}))
def test_every_reader_rank_gets_its_heads_from_a_holder_of_any_size(heads):
    """Blocks whose head h holds the value h, sharded as a holder of N ranks holds them,
    gathered by each rank of a reader of M ranks through its plan: each reader rank's
    block is what it holds computing them itself."""
    sizes = [n for h, n in SPLITS if h == heads]
    full = torch.arange(heads).view(1, heads, 1).expand(4, heads, 3)  # (tokens, heads, head_dim)
    for holder, reader in itertools.product(sizes, sizes):
        held = [full[:, kv_head_range(heads, holder, i)] for i in range(holder)]
        for rank in range(reader):
            mine = kv_head_range(heads, reader, rank)
            got = torch.full((4, len(mine), 3), -1)
            parts = reshard_plan(heads, holder, reader, rank)
            for part in parts:
                got[:, part.local] = held[part.rank][:, part.heads]
            assert torch.equal(got, full[:, mine]), (heads, holder, reader, rank, parts)
            # one part per run of heads a holder rank holds side by side: as few reads as can be
            assert len(parts) == len({p.rank for p in parts})
