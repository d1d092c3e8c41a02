"""Triton rotary embedding and SwiGLU activation; same semantics as :mod:`kernels.fused` (the
torch reference).

Both compute in float32 but round wherever the reference rounds (its every op returns the
activation dtype), so in bf16/fp16 they agree with it bit for bit up to the libm-level
differences of exp; in float32 those roundings are no-ops. Launchers read no device values
(no host sync), so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnibus.kernels._tiles import next_pow2

# Columns of the intermediate dim per silu_and_mul program.
_SILU_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# rotary embedding
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rotate_heads(
    x_ptr, num_heads, half, stride_h, stride_d, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Rotates in place the (num_heads, 2 * half) heads of one token at ``x_ptr``; c1/s1
    are the cos/sin of the first half of the dims, c2/s2 of the second, (1, BLOCK_HALF)."""
    h = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    d = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    mask = (h < num_heads) & (d < half)
    ptr1 = x_ptr + h * stride_h + d * stride_d
    ptr2 = ptr1 + half * stride_d
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1); each product and the
    # sum rounded to the activation dtype, as the reference's ops are.
    o1 = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    o2 = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(ptr1, o1.to(dtype), mask=mask)
    tl.store(ptr2, o2.to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr,
    num_heads, num_kv_heads, half,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_ct, stride_cd,
    stride_st, stride_sd,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program per token: looks its cos/sin row up once, rotates all its q and k heads."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]  # (1, BLOCK_HALF)
    d_mask = d < half
    dtype = q_ptr.dtype.element_ty
    cos_row = cos_ptr + pos * stride_ct
    sin_row = sin_ptr + pos * stride_st
    # The reference casts the float32 table rows to the activation dtype first. Both halves
    # are read, so tables need not be half-duplicated for the result to match the reference.
    c1 = tl.load(cos_row + d * stride_cd, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_row + (d + half) * stride_cd, mask=d_mask, other=0.0)
    c2 = c2.to(dtype).to(tl.float32)
    s1 = tl.load(sin_row + d * stride_sd, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_row + (d + half) * stride_sd, mask=d_mask, other=0.0)
    s2 = s2.to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, num_heads, half, stride_qh, stride_qd,
                  c1, c2, s1, s2, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, num_kv_heads, half, stride_kh, stride_kd,
                  c1, c2, s1, s2, BLOCK_HK, BLOCK_HALF)


def rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.fused.rope_ref` (same arguments), rotating IN PLACE.

    q and k may have any strides, e.g. views split from a fused qkv projection output (row
    stride H*D + 2*KVH*D); they must not overlap. Returns ``(q, k)`` themselves.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or k.shape[0] != num_tokens:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: need (T, H, D) and "
                         "(T, KVH, D) with the same even D")
    if k.dtype != q.dtype:
        raise ValueError(f"k is {k.dtype}, q is {q.dtype}")
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, cos_table, sin_table, positions,
        num_heads, num_kv_heads, half,
        *q.stride(), *k.stride(), *cos_table.stride(), *sin_table.stride(),
        BLOCK_HQ=next_pow2(num_heads), BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
    return q, k


# ---------------------------------------------------------------------------------------------
# silu_and_mul
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, inter,
    stride_gt, stride_gi,
    stride_ot, stride_oi,
    BLOCK: tl.constexpr,
):
    """out[t, cols] = silu(gate[t, cols]) * up[t, cols] for one tile of BLOCK columns."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gate_up_ptr + t * stride_gt + cols * stride_gi
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + inter * stride_gi, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # x / (1 + exp(-x)) as torch's silu computes it (not x * sigmoid(x), one more rounding),
    # rounded to the activation dtype before the product as F.silu(gate) * up does.
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_oi,
             (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(
    gate_up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of :func:`kernels.fused.silu_and_mul_ref`.

    Args:
        gate_up: (T, 2I), any strides.
        out: optional (T, I) output, any strides.

    Returns:
        (T, I) in gate_up's dtype (``out`` itself when given).
    """
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has an odd width {width}")
    inter = width // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(_SILU_BLOCK, next_pow2(inter))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
        gate_up, out, inter, *gate_up.stride(), *out.stride(), BLOCK=block,
    )
    return out
