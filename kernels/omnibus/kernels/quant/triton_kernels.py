"""Triton W4A16 matmul: same semantics as :func:`kernels.quant.reference.int4_matmul_ref`.

Each program computes a (BLOCK_M tokens, BLOCK_N output columns) tile of ``y = x @ w.T``.
Per step of BLOCK_K input columns it loads BLOCK_N x BLOCK_K / 2 bytes of the packed
weight, splits each byte into its two nibbles (interleaved back into input order),
dequantizes them in registers with the step's one scale and zero per output column
(BLOCK_K divides the group, so a step never straddles two groups) and feeds the tile to
``tl.dot`` in x's dtype, accumulating in float32. The weight is read once per row tile:
at decode (T <= BLOCK_M) exactly once, which is what bounds the kernel there.

Split-K: at decode the output tiles alone can be fewer than the SMs (4096 columns are 64
tiles of 64), leaving most of the memory bandwidth unused, so the reduction is also split
over a third grid axis; each split writes float32 partial sums, added up by one torch sum
(deterministic, unlike atomics). The launcher reads no device values (no host sync), so it
can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnibus.kernels._tiles import dot_precision, tile
from omnibus.kernels.quant.reference import check_int4_args

_BLOCK_N = 64
_MAX_BLOCK_K = 128
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _int4_matmul_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, out_ptr,
    num_tokens, out_dim, in_dim, k_per_split,
    stride_xt, stride_xk,
    stride_wn, stride_wb,
    stride_sn, stride_sg,
    stride_zn, stride_zg,
    stride_os, stride_ot, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[split, rows, cols] = x[rows, k-range] @ w[cols, k-range].T for this program's
    split of the input columns, k-range = [split * k_per_split, + k_per_split)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) tokens
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) output columns = weight rows
    row_mask = rows < num_tokens
    col_mask = cols < out_dim
    offs_k = tl.arange(0, BLOCK_K)
    offs_b = tl.arange(0, BLOCK_K // 2)  # the step's packed bytes
    # int64: rows * stride and cols * stride can pass 2**31 at long prefills / wide weights
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xt  # (BLOCK_M, 1)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    s_rows = scales_ptr + cols.to(tl.int64) * stride_sn  # (BLOCK_N,)
    z_rows = zeros_ptr + cols.to(tl.int64) * stride_zn

    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_dim)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # in_dim is a multiple of GROUP, hence of BLOCK_K: no step needs a mask along K.
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_rows + (k0 + offs_k)[None, :] * stride_xk,
                    mask=row_mask[:, None], other=0.0)  # (BLOCK_M, BLOCK_K)
        packed = tl.load(w_rows + (k0 // 2 + offs_b)[None, :] * stride_wb,
                         mask=col_mask[:, None], other=0)  # (BLOCK_N, BLOCK_K // 2) uint8
        # byte j holds input column 2j (low nibble) and 2j + 1 (high nibble)
        q = tl.interleave(packed & 0xF, packed >> 4)  # (BLOCK_N, BLOCK_K) codes 0..15
        g = k0 // GROUP
        scale = tl.load(s_rows + g * stride_sg, mask=col_mask, other=0.0)  # (BLOCK_N,)
        zero = tl.load(z_rows + g * stride_zg, mask=col_mask, other=0.0)
        w = (q.to(tl.float32) - 8.0) * scale[:, None] + zero[:, None]  # (BLOCK_N, BLOCK_K)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)

    out_ptrs = (out_ptr + split * stride_os + rows.to(tl.int64)[:, None] * stride_ot
                + cols[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def block_k_for(group: int) -> int:
    """Input columns per step: the largest power of two dividing ``group``, at most 128, so
    that a step lies inside one group (one scale and zero per column) and K needs no mask."""
    return min(_MAX_BLOCK_K, group & -group)


def split_k_for(output_tiles: int, k_steps: int, num_sms: int) -> int:
    """Splits of the reduction: enough programs for about two per SM when the output tiles
    alone are fewer than the SMs, each split keeping at least 4 steps of BLOCK_K (so the
    partial sums stay small beside the weight bytes each split reads)."""
    if output_tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(2 * num_sms, output_tiles), k_steps // 4))


def int4_matmul_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.quant.reference.int4_matmul_ref` (same arguments).

    Args:
        x: (T, in) float32, bfloat16 or float16 activations, any strides.
        packed, scales, zeros: as in the reference, any strides.
        group: a multiple of 16 (32, 64, 128 are the usual ones).
        split_k: splits of the reduction (each a multiple of BLOCK_K input columns); by
            default chosen by :func:`split_k_for` from the SM count on CUDA, 1 elsewhere.

    Returns:
        (T, out) in x's dtype; float32 accumulation (float32 dot operands stay float32).

    Raises:
        ValueError: shapes that do not fit, a group that is not a multiple of 16, or
            another activation dtype.
    """
    check_int4_args(x, packed, scales, zeros, group)
    if group % 16:
        raise ValueError(f"int4_matmul_triton: group must be a multiple of 16, got {group}")
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"int4_matmul_triton: x must be float32, bfloat16 or float16, got {x.dtype}")
    num_tokens, in_dim = x.shape
    out_dim = packed.shape[0]
    out = torch.empty(num_tokens, out_dim, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or out_dim == 0 or in_dim == 0:
        return out.zero_()  # an empty sum

    block_m, block_n, block_k = tile(num_tokens), tile(out_dim, hi=_BLOCK_N), block_k_for(group)
    tiles_m, tiles_n = triton.cdiv(num_tokens, block_m), triton.cdiv(out_dim, block_n)
    k_steps = in_dim // block_k
    if split_k is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        split_k = split_k_for(tiles_m * tiles_n, k_steps, num_sms)
    steps_per_split = triton.cdiv(k_steps, max(1, min(split_k, k_steps)))
    splits = triton.cdiv(k_steps, steps_per_split)  # no split left without columns
    # One split stores straight into the output; more store float32 partials to add up.
    dest = out if splits == 1 else torch.empty(splits, num_tokens, out_dim, dtype=torch.float32,
                                               device=x.device)
    stride_os = 0 if splits == 1 else dest.stride(0)
    _int4_matmul_kernel[(tiles_m, tiles_n, splits)](
        x, packed, scales, zeros, dest,
        num_tokens, out_dim, in_dim, steps_per_split * block_k,
        *x.stride(), *packed.stride(), *scales.stride(), *zeros.stride(),
        stride_os, dest.stride(-2), dest.stride(-1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype),
    )
    if splits > 1:
        out.copy_(dest.sum(dim=0))  # float32 sum, one rounding to x's dtype
    return out
