"""The device tier: `max_loras` slots of stacked, zero-padded LoRA weights.

For every layer and projection the slots share one A tensor (slots, max_rank, in) and
one B tensor (slots, out, max_rank), preallocated, so a batch indexes them by slot.
Outside its occupant's footprint (the projections it adapts, up to its rank) a slot
holds zeros: ranks and projections an adapter lacks contribute nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.lora.adapters import FUSED, PROJECTIONS, AdapterWeights, proj_dims
from omnibus.engine.model.loader import FUSED_PARTS  # the column-parallel projections, by fused part
from omnibus.engine.parallel.shard import ShardPlan


@dataclass(frozen=True)
class Footprint:
    """What a fill may have written into a slot: at most ranks [0, rank) of these
    (layer, projection)s (a module's own rank may be lower: rank_pattern)."""

    rank: int = 0
    keys: frozenset[tuple[int, str]] = frozenset()


class DeviceSlots:
    """Slot contents, pins and LRU order. Step thread only."""

    def __init__(self, num_slots: int, max_rank: int, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.device, self.dtype, self.model_config = device, dtype, model_config
        self.num_slots, self.max_rank = num_slots, max_rank
        self.plan: ShardPlan | None = None  # tensor parallelism: this rank's rows and columns
        self.mirror: Callable[[tuple], None] | None = None  # tells the other ranks each fill and clear
        self._allocate(proj_dims(model_config))
        n = num_slots
        self.names: list[str | None] = [None] * n
        self.targets: list[frozenset[str]] = [frozenset()] * n  # projections each slot's adapter adapts
        self.pins = [0] * n  # running sequences using each slot
        self.evicted: Counter[str] = Counter()  # adapter -> fills that replaced it with another
        self._footprints = [Footprint()] * n  # kept after an unload: the next fill clears it
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))

    def _allocate(self, dims: dict[str, tuple[int, int]]) -> None:
        n, r, dtype, device, layers = self.num_slots, self.max_rank, self.dtype, self.device, self.model_config.num_layers
        # stacked[layer][proj] = (A (slots, r, in), B (slots, out, r)); zeros where unused
        self.stacked = [
            {p: (torch.zeros(n, r, dims[p][0], dtype=dtype, device=device),
                 torch.zeros(n, dims[p][1], r, dtype=dtype, device=device)) for p in PROJECTIONS}
            for _ in range(layers)
        ]
        # scales[layer, p] = each slot's scale for PROJECTIONS[p] (rank/alpha patterns vary it)
        self.scales = torch.zeros(layers, len(PROJECTIONS), n, dtype=torch.float32, device=device)
        # views of it per layer and projection, made once (not per step): layer -> proj -> (n,)
        self.proj_scales = [{p: self.scales[layer, i] for i, p in enumerate(PROJECTIONS)} for layer in range(layers)]
        # fused module -> (projection, first column, end column) inside its output
        self.columns: dict[str, list[tuple[str, int, int]]] = {}
        for fused, projs in FUSED.items():
            lo, cols = 0, []
            for p in projs:
                cols.append((p, lo, lo + dims[p][1]))
                lo += dims[p][1]
            self.columns[fused] = cols

    def shard_over(self, plan: ShardPlan, mirror: Callable[[tuple], None] | None = None) -> None:
        """Hold this rank's part of every adapter from now on (before any fill): B's rows of
        the column-parallel projections, A's columns of the row-parallel ones (whose partial
        deltas the layer's all-reduce sums). `mirror` (rank 0) hears each fill and clear,
        so the other ranks' slots hold the same adapters."""
        assert all(name is None for name in self.names), "shard the slots before filling them"
        self.plan, self.mirror = plan, mirror
        self._allocate(sharded_dims(self.model_config, plan))

    @property
    def evictions(self) -> int:
        """Fills that replaced another adapter."""
        return sum(self.evicted.values())

    def slot_of(self, name: str) -> int | None:
        try:
            return self.names.index(name)
        except ValueError:
            return None

    def free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one; None when all are pinned."""
        free = [s for s in self._lru if self.pins[s] == 0]
        return next((s for s in free if self.names[s] is None), free[0] if free else None)

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self._lru.move_to_end(slot)

    def unpin(self, slot: int) -> None:
        if self.pins[slot] > 0:
            self.pins[slot] -= 1

    def fill(self, slot: int, weights: AdapterWeights) -> None:
        """Put `weights` into `slot`. Zeroes only what the previous occupant wrote and this
        adapter does not overwrite; copies are non-blocking (the host tensors are pinned on
        CUDA, and the caching host allocator keeps them alive until the copies ran)."""
        if self.mirror is not None:
            self.mirror(("lora_fill", slot, weights))
        if self.plan is not None:
            weights = shard_adapter(weights, self.plan)
        old_name = self.names[slot]
        if old_name is not None:
            self.evicted[old_name] += 1
        old = self._footprints[slot]
        for key in old.keys:
            lo = weights.tensors[key][0].shape[0] if key in weights.tensors else 0  # its rank
            if lo < old.rank:
                a, b = self.stacked[key[0]][key[1]]
                a[slot, lo:old.rank].zero_()
                b[slot, :, lo:old.rank].zero_()
        for (layer, proj), (a, b) in weights.tensors.items():
            sa, sb = self.stacked[layer][proj]
            rank = a.shape[0]
            sa[slot, :rank].copy_(a, non_blocking=True)
            sb[slot, :, :rank].copy_(b, non_blocking=True)
        self._footprints[slot] = Footprint(weights.spec.rank, frozenset(weights.tensors))
        self.scales[:, :, slot].copy_(weights.scales, non_blocking=True)
        self.names[slot] = weights.spec.name
        self.targets[slot] = weights.targets

    def clear(self, slot: int) -> None:
        """Empty an unpinned slot (its weights stay until the next fill, with scale 0)."""
        if self.mirror is not None:
            self.mirror(("lora_clear", slot))
        self.names[slot] = None
        self.targets[slot] = frozenset()
        self.scales[:, :, slot].fill_(0.0)


def sharded_dims(cfg: ModelConfig, plan: ShardPlan) -> dict[str, tuple[int, int]]:
    """proj_dims of one tensor-parallel rank."""
    dims = dict(proj_dims(cfg))
    for proj, (fused, part) in FUSED_PARTS.items():
        rows = plan.part_rows[fused][part]
        dims[proj] = (dims[proj][0], rows.stop - rows.start)
    for proj in ("o_proj", "down_proj"):
        start, stop = plan.columns[proj]
        dims[proj] = (stop - start, dims[proj][1])
    return dims


def shard_adapter(weights: AdapterWeights, plan: ShardPlan) -> AdapterWeights:
    """One rank's part of an adapter (S-LoRA's split): B's rows where the layer splits its
    output rows, A's columns where it splits its input columns."""
    tensors = {}
    for (layer, proj), (a, b) in weights.tensors.items():
        if proj in FUSED_PARTS:
            fused, part = FUSED_PARTS[proj]
            b = b[plan.part_rows[fused][part]]
        else:
            start, stop = plan.columns[proj]
            a = a[:, start:stop]
        tensors[layer, proj] = (a, b)
    return replace(weights, tensors=tensors)
