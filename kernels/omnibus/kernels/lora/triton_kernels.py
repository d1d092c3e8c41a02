"""Triton SGMV kernels behind :func:`kernels.lora.lora_shrink_triton` and
:func:`kernels.lora.lora_expand_triton` (see there for semantics).

Grid: (segment, tile of BLOCK_M tokens, output tile). The host does not read the segment
lengths (no device sync): the token-tile axis is sized for the longest possible segment and
tiles past their segment's end exit after a few scalar loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnibus.kernels._tiles import dot_precision, tile

_BLOCK_M = 16


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr,
    in_dim, rank,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_ot, stride_or,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[rows, r-tile] = x[rows] @ A[slot, r-tile].T, or zeros for slot -1."""
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    r_block = tl.program_id(2)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)

    rows = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < end
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    # No adapter, or a tile past the segment: skip the reduction (the tile stores zeros).
    k_end = tl.where((slot >= 0) & (start + m_block * BLOCK_M < end), in_dim, 0)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_as

    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < in_dim
        x = tl.load(
            x_ptr + rows[:, None] * stride_xt + kk[None, :] * stride_xk,
            mask=row_mask[:, None] & k_mask[None, :], other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        a = tl.load(
            a_base + offs_r[None, :] * stride_ar + kk[:, None] * stride_ak,
            mask=r_mask[None, :] & k_mask[:, None], other=0.0,
        )  # (BLOCK_K, BLOCK_R): A[slot] transposed
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_r[None, :] * stride_or,
        acc.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & r_mask[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr, b_ptr, out_ptr, scales_ptr, seg_starts_ptr, seg_slots_ptr,
    out_dim, rank,
    stride_yt, stride_yr,
    stride_bs, stride_bn, stride_br,
    stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[rows, n-tile] += scale[slot] * y[rows] @ B[slot, n-tile].T; nothing for slot -1.
    The whole (padded) rank is one reduction tile."""
    seg = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    first = start + m_block * BLOCK_M
    # Tiles past their segment's end, and segments without adapter, exit after three scalar
    # loads: the grid is sized for the longest segment, so most tiles of a batch of many
    # short segments are such tiles.
    if (slot >= 0) & (first < end):
        slot_or_0 = slot.to(tl.int64)
        rows = first + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        row_mask = rows < end
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < out_dim
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank

        y = tl.load(
            y_ptr + rows[:, None] * stride_yt + offs_r[None, :] * stride_yr,
            mask=row_mask[:, None] & r_mask[None, :], other=0.0,
        )  # (BLOCK_M, BLOCK_R)
        b = tl.load(
            b_ptr + slot_or_0 * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
            mask=r_mask[:, None] & n_mask[None, :], other=0.0,
        )  # (BLOCK_R, BLOCK_N): B[slot] transposed
        scale = tl.load(scales_ptr + slot_or_0).to(tl.float32)
        delta = tl.dot(y.to(b.dtype), b, input_precision=DOT_PRECISION) * scale  # (BLOCK_M, BLOCK_N)

        mask = row_mask[:, None] & n_mask[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
        prev = tl.load(out_ptrs, mask=mask, other=0.0)
        tl.store(out_ptrs, (prev.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor | None,
    max_seg_len: int | None,
) -> torch.Tensor:
    """Launches ``_shrink_kernel``; see :func:`kernels.lora.lora_shrink_triton`."""
    num_tokens, in_dim = x.shape
    rank = lora_a.shape[1]
    if out is None:
        # Zeros, so tokens outside every segment read 0 as in the reference.
        out = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    num_segs = seg_slots.shape[0]
    longest = num_tokens if max_seg_len is None else max_seg_len
    if num_segs == 0 or longest == 0:
        return out
    block_r = tile(rank)
    grid = (num_segs, triton.cdiv(longest, _BLOCK_M), triton.cdiv(rank, block_r))
    _shrink_kernel[grid](
        x, lora_a, out, seg_starts, seg_slots, in_dim, rank,
        *x.stride(), *lora_a.stride(), *out.stride(),
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=tile(in_dim, hi=128),
        DOT_PRECISION=dot_precision(x.dtype),
    )
    return out


def expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int | None,
) -> None:
    """Launches ``_expand_kernel``; see :func:`kernels.lora.lora_expand_triton`."""
    num_tokens, out_dim = out.shape
    rank = lora_b.shape[2]
    num_segs = seg_slots.shape[0]
    longest = num_tokens if max_seg_len is None else max_seg_len
    if num_segs == 0 or longest == 0:
        return
    block_n = tile(out_dim)
    grid = (num_segs, triton.cdiv(longest, _BLOCK_M), triton.cdiv(out_dim, block_n))
    _expand_kernel[grid](
        y, lora_b, out, scales, seg_starts, seg_slots, out_dim, rank,
        *y.stride(), *lora_b.stride(), *out.stride(),
        BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_R=tile(rank, hi=1 << 16),
        DOT_PRECISION=dot_precision(lora_b.dtype),
    )
