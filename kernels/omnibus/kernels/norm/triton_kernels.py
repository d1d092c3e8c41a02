"""Triton RMSNorm, alone and fused with the residual add; same semantics as
:mod:`kernels.norm` (the torch reference).

One program per row holds the whole row in registers (BLOCK_H, the hidden size padded to a
power of two and masked), so the row is read once: statistics in float32, then the same
roundings as the reference (normalized row to the activation dtype, then times the weight).
Launchers read no device values (no host sync), so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnibus.kernels._tiles import next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    hidden, eps,
    stride_xt, stride_xh,
    stride_rt, stride_rh,
    stride_ot, stride_oh,
    ADD_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Normalizes one row; with ADD_RESIDUAL, first stores residual + x into the residual
    row and normalizes that sum."""
    t = tl.program_id(0).to(tl.int64)  # t * stride can exceed 2**31 at long prefills
    offs = tl.arange(0, BLOCK_H)
    mask = offs < hidden
    x = tl.load(x_ptr + t * stride_xt + offs * stride_xh, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        res_ptrs = res_ptr + t * stride_rt + offs * stride_rh
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        # Rounded to the activation dtype before the norm reads it, as the unfused add does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # Cast back to the activation dtype before the weight, like transformers' LlamaRMSNorm.
    y = (x32 * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh, y.to(out_ptr.dtype.element_ty),
             mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.promote_types(weight.dtype, x.dtype),
                          device=x.device)
    if num_tokens == 0:
        return out
    block_h = next_pow2(hidden)
    res = x if residual is None else residual  # unused without ADD_RESIDUAL
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, hidden, eps,
        *x.stride(), *res.stride(), *out.stride(),
        ADD_RESIDUAL=residual is not None, BLOCK_H=block_h,
        # About 16 elements per thread: wide rows get more warps instead of spilling.
        num_warps=min(16, max(1, block_h // 512)),
    )
    return out


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton version of :func:`kernels.norm.rms_norm_ref`.

    Args:
        x: (T, H) activations, any strides.
        weight: (H,) contiguous norm weight.
        eps: added to the mean of squares.
        out: optional (T, H) output, any strides; may be ``x`` itself (each row is read
            whole before it is written).

    Returns:
        (T, H) in the promoted dtype of weight and x (``out`` itself when given).
    """
    return _launch(x, None, weight, eps, out)


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.norm.add_rms_norm_ref`: ``residual += x`` IN PLACE,
    then returns ``(rms_norm(residual), residual)``.

    Args:
        x: (T, H) the sublayer output to add, any strides.
        residual: (T, H) residual stream, same dtype as x, any strides; updated in place.
        weight, eps: as in :func:`rms_norm_triton`.
        out: optional (T, H) output; may be ``x`` itself, not ``residual``.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    return _launch(x, residual, weight, eps, out), residual
