"""Reading KV that an engine of another tensor-parallel size holds.

Each rank's pool block is (tokens, its KV heads, head_dim): rank r of N holds the heads
`kv_head_range(H, N, r)` (parallel/shard.py; replicated when there are fewer heads than
ranks). A reader of M ranks reads, on each of its ranks, the holder ranks' blocks that
hold its heads into host scratch shaped as the holder's blocks, then copies each head
slice into its own blocks (shards.py `KvShard.read_resharded`). A head of this rank's is
one holder rank's contiguous head slice, so a read is one range per run of blocks and
region, as a same-size read is; a reader with more ranks than the holder reads the
holder's whole blocks and keeps its heads (more bytes than it needs: H/N of H/M).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnibus.engine.parallel.shard import kv_head_range


@dataclass(frozen=True)
class Layout:
    """A pool layout as a handle names it (connector.py `pool_layout`)."""

    layers: int
    block: tuple[int, ...]  # one rank's block: tokens, KV heads, head_dim
    dtype: str
    ranks: int

    @classmethod
    def parse(cls, text: str) -> Layout | None:
        """The layout `text` names, or None when it is not one (a router's handle is input)."""
        shape, _, rest = text.partition(":")
        dtype, _, tp = rest.partition("/tp")
        try:
            layers, *block = (int(x) for x in shape.split("x"))
            ranks = int(tp) if tp else 1
        except ValueError:
            return None
        if not dtype or len(block) != 3 or min(layers, ranks, *block) < 1:
            return None
        return cls(layers, tuple(block), dtype, ranks)


def splits(num_kv_heads: int, ranks: int) -> bool:
    """Whether `num_kv_heads` split over `ranks` as tensor parallelism splits them."""
    return num_kv_heads % ranks == 0 if num_kv_heads >= ranks else ranks % num_kv_heads == 0


def reshardable(holder: Layout, reader: Layout, num_kv_heads: int) -> bool:
    """Whether a reader of `reader`'s layout can read a holder of `holder`'s, the model
    having `num_kv_heads` KV heads: the same layers, block tokens, head size and dtype,
    another rank count, and the holder's block holding its share of those heads."""
    return (holder.ranks != reader.ranks and holder.layers == reader.layers and holder.dtype == reader.dtype
            and holder.block[0] == reader.block[0] and holder.block[2] == reader.block[2]
            and splits(num_kv_heads, holder.ranks)
            and holder.block[1] == len(kv_head_range(num_kv_heads, holder.ranks, 0)))


@dataclass(frozen=True)
class Part:
    """Heads [local] of this rank's blocks come from heads [heads] of holder rank `rank`'s."""

    rank: int
    heads: slice
    local: slice


def reshard_plan(num_kv_heads: int, holder_ranks: int, reader_ranks: int, reader_rank: int) -> list[Part]:
    """Where reader rank `reader_rank`'s heads are in a holder of `holder_ranks` ranks: runs
    of heads one holder rank holds side by side. A head several holder ranks replicate is
    read from one of them, spread over the reader's ranks."""
    holders = [kv_head_range(num_kv_heads, holder_ranks, i) for i in range(holder_ranks)]
    parts: list[Part] = []
    for c, g in enumerate(kv_head_range(num_kv_heads, reader_ranks, reader_rank)):
        having = [i for i, heads in enumerate(holders) if g in heads]
        i = having[reader_rank % len(having)]
        a = g - holders[i].start
        last = parts[-1] if parts else None
        if last is not None and last.rank == i and last.heads.stop == a and last.local.stop == c:
            parts[-1] = Part(i, slice(last.heads.start, a + 1), slice(last.local.start, c + 1))
        else:
            parts.append(Part(i, slice(a, a + 1), slice(c, c + 1)))
    return parts
