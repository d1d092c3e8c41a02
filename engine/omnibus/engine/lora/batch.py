"""One step's adapter segments, applied to each targeted projection of each layer."""

from __future__ import annotations

import torch

from omnibus.engine.lora.slots import DeviceSlots
from omnibus.engine.worker.transfer import to_device
from omnibus.kernels import lora_expand, lora_shrink


class LoraBatch:
    """A step's adapter segments: tokens [starts[s], starts[s+1]) use slot slots[s]
    (-1: base model only). Adds `scale · (x Aᵀ) Bᵀ` per segment (kernels/omnibus/kernels/lora)."""

    def __init__(self, slots: DeviceSlots, runs: list[tuple[int, int]]) -> None:
        """`runs`: (slot, number of tokens) of each scheduled sequence, in token order."""
        self.slots, self.runs = slots, runs  # runs: what another tensor-parallel rank rebuilds it from
        starts, seg_slots = [0], []
        for slot, n in runs:
            if seg_slots and slot == seg_slots[-1]:
                starts[-1] += n  # same adapter as the previous sequence: one segment
            else:
                seg_slots.append(slot)
                starts.append(starts[-1] + n)
        dev = slots.device
        self.seg_starts = to_device(starts, torch.int32, dev)
        self.seg_slots = to_device(seg_slots, torch.int32, dev)
        self.max_seg_len = max(b - a for a, b in zip(starts, starts[1:]))  # sizes the kernels' grid
        # Only projections some adapter in this batch targets cost anything.
        active = frozenset().union(*(slots.targets[s] for s in set(seg_slots) if s >= 0))
        self.columns = {fused: [c for c in cols if c[0] in active] for fused, cols in slots.columns.items()}

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> None:
        """out (T, out_fused) += LoRA delta of every projection in `fused`, per segment."""
        stacked, scales = self.slots.stacked[layer], self.slots.proj_scales[layer]
        for proj, lo, hi in self.columns[fused]:
            a, b = stacked[proj]
            y = lora_shrink(x, a, self.seg_starts, self.seg_slots, self.max_seg_len)  # (T, r) float32
            lora_expand(y, b, self.seg_starts, self.seg_slots, scales[proj], out[:, lo:hi], self.max_seg_len)
