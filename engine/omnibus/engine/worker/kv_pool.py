"""The paged KV pool's tensors: each layer's K and V cache on the device, the prefix
cache's host tier beside it, and the copies between the two (core/block_allocator.py
`KvCopy`)."""

from __future__ import annotations

import torch

from omnibus.engine.config import ModelConfig
from omnibus.engine.parallel.group import TensorParallel
from omnibus.engine.parallel.shard import local_kv_heads


def kv_caches(mc: ModelConfig, tp: TensorParallel, num_blocks: int, block_size: int, dtype: torch.dtype,
              device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) cache of `num_blocks` blocks for this rank's KV heads, zeros (not
    empty: padded attention reads of the null block must be finite)."""
    shape = (num_blocks, block_size, local_kv_heads(mc, tp), mc.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(mc.num_layers)]


def host_caches(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The host tier: each layer's (K, V) of `num_blocks` blocks shaped as the device's, in
    pinned host memory on CUDA (so copies run on the device's stream, in order)."""
    if not num_blocks:
        return []
    pin = kv_caches[0][0].device.type == "cuda"
    return [tuple(torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)  # type: ignore[misc]
                  for t in layer) for layer in kv_caches]


def copy_kv(device: list[tuple[torch.Tensor, torch.Tensor]], host: list[tuple[torch.Tensor, torch.Tensor]],
            copies: list) -> None:
    """Make the allocator's queued copies (core/block_allocator.py KvCopy) in their order,
    every layer's K and V. On CUDA each block is one `copy_` between the device pool and
    its pinned host slot, queued on the current stream (so a save completes before a later
    load from that slot and before the forward overwrites the block, without a host sync);
    on the CPU, runs of one direction at a time, one index_copy_ each."""
    if not copies:
        return
    if device[0][0].device.type == "cuda":
        for c in copies:
            for dev_layer, host_layer in zip(device, host):
                for d, h in zip(dev_layer, host_layer):
                    if c.save:
                        h[c.slot].copy_(d[c.block], non_blocking=True)
                    else:
                        d[c.block].copy_(h[c.slot], non_blocking=True)
        return
    i = 0
    while i < len(copies):
        j = i
        while j < len(copies) and copies[j].save == copies[i].save:
            j += 1
        blocks = torch.tensor([c.block for c in copies[i:j]], dtype=torch.long)
        slots = torch.tensor([c.slot for c in copies[i:j]], dtype=torch.long)
        for dev_layer, host_layer in zip(device, host):
            for d, h in zip(dev_layer, host_layer):
                if copies[i].save:
                    h.index_copy_(0, slots, d.index_select(0, blocks))
                else:
                    d.index_copy_(0, blocks, h.index_select(0, slots))
        i = j


class KvMarks:
    """The progress words of the step's early-held prefills (kv_transfer/connector.py
    hold_early): after layer l's forward, word l of each says its KV is final up to the
    end of this step's chunk. Host words, written in order on the host: only pools read
    in place on the CPU give early handles, and there the forward runs synchronously."""

    __slots__ = ("_marks",)

    def __init__(self, marks: list[tuple[object, int]]) -> None:
        self._marks = marks  # (its progress words, the chunk's end)

    def layer_done(self, layer: int | None) -> None:
        """Layer `layer`'s KV of the step is written (None: every layer's)."""
        at = slice(None) if layer is None else layer
        for words, end in self._marks:
            words[at] = end  # type: ignore[index]


def kv_marks(scheduled) -> KvMarks | None:
    """The step's marks, or None when no planned chunk belongs to an early hold."""
    marks = [(item.seq.kv_progress, item.start + item.num_tokens) for item in scheduled
             if item.seq.kv_progress is not None]
    return KvMarks(marks) if marks else None
