"""Batched multi-LoRA (SGMV style): torch reference and Triton kernels.

A batch's tokens are split into contiguous segments; tokens ``[seg_starts[s], seg_starts[s+1])``
use the adapter in slot ``seg_slots[s]`` (-1: no adapter). Adapters are stacked, their rank
zero-padded to ``max_rank``:

- shrink: ``y = x @ A[slot].T`` with lora_a (num_slots, max_rank, in_dim)
- expand: ``out += scales[slot] * y @ B[slot].T`` with lora_b (num_slots, out_dim, max_rank)

Triton is imported inside the Triton entry points only, so this module imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator


def lora_shrink_ref(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    """LoRA down-projection of each token with its segment's adapter.

    Args:
        x: (T, in_dim) input activations.
        lora_a: (num_slots, max_rank, in_dim) stacked A matrices, rank zero-padded.
        seg_starts: int32 (S + 1,) segment boundaries; segments should cover all T tokens.
        seg_slots: int32 (S,) adapter slot of each segment, -1 for none.

    Returns:
        (T, max_rank) float32; zero for tokens without adapter (or outside every segment).
    """
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot, tokens in _tokens_by_slot(seg_starts, seg_slots):
        y[tokens] = x[tokens].float() @ lora_a[slot].float().T  # (n, in) @ (in, R)
    return y


def lora_expand_ref(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """LoRA up-projection added in place: ``out[t] += scales[slot] * y[t] @ B[slot].T``.

    Args:
        y: (T, max_rank) shrink output.
        lora_b: (num_slots, out_dim, max_rank) stacked B matrices, rank zero-padded.
        seg_starts, seg_slots: segments as in :func:`lora_shrink_ref`.
        scales: float32 (num_slots,) per-adapter scale (alpha / rank).
        out: (T, out_dim) updated in place (may be a strided view, e.g. a slice of a fused
            projection's output); rows without adapter are left untouched.
    """
    for slot, tokens in _tokens_by_slot(seg_starts, seg_slots):
        delta = (y[tokens].float() @ lora_b[slot].float().T) * scales[slot].float()  # (n, out)
        if isinstance(tokens, slice) and out.dtype == torch.float32:
            out[tokens].add_(delta)  # one contiguous run: update the view in place, no gather
        else:  # sum in float32 and round once, like the kernel
            out[tokens] = (out[tokens].float() + delta).to(out.dtype)


def _tokens_by_slot(
    seg_starts: torch.Tensor, seg_slots: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor | slice]]:
    """Yields (slot, tokens) once per adapter in use: one matmul per adapter rather than
    per segment, since a batch often holds many short segments of the same adapter. An
    adapter whose tokens form one run (the engine groups them so) comes as a slice."""
    starts = seg_starts.tolist()
    slots = seg_slots.tolist()
    by_slot: dict[int, list[tuple[int, int]]] = {}
    for s, slot in enumerate(slots):
        if slot >= 0 and starts[s + 1] > starts[s]:
            by_slot.setdefault(slot, []).append((starts[s], starts[s + 1]))
    for slot, runs in by_slot.items():
        if len(runs) == 1:
            yield slot, slice(*runs[0])
        else:
            tokens = [t for lo, hi in runs for t in range(lo, hi)]
            yield slot, torch.tensor(tokens, device=seg_starts.device)


def lora_shrink_triton(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_seg_len: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`lora_shrink_ref` (same arguments).

    Extra arguments:
        out: optional (T, max_rank) float32 output. Every token of every segment is written
            (zeros for slot -1); tokens outside all segments are left untouched.
        max_seg_len: longest segment, to size the grid; defaults to T (no device sync, most
            programs of short segments then exit at once).
    """
    from omnibus.kernels.lora import triton_kernels as lora_triton

    return lora_triton.shrink(x, lora_a, seg_starts, seg_slots, out, max_seg_len)


def lora_expand_triton(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    max_seg_len: int | None = None,
) -> None:
    """Triton version of :func:`lora_expand_ref` (same arguments, plus ``max_seg_len`` as in
    :func:`lora_shrink_triton`)."""
    from omnibus.kernels.lora import triton_kernels as lora_triton

    lora_triton.expand(y, lora_b, seg_starts, seg_slots, scales, out, max_seg_len)
