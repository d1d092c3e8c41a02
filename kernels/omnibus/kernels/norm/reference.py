"""RMSNorm, alone and fused with the residual add, in plain PyTorch: the reference for the
Triton kernels (:mod:`kernels.norm_triton`) and the engine's CPU path.

The op order is transformers' LlamaRMSNorm (float32 statistics, the normalized row cast back
to the activation dtype before the weight multiplies it), so outputs agree with it bit for bit
and greedy decoding stays token-exact.
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalize(x)`` over the last dim.

    Args:
        x: (..., H) activations (the engine passes (T, H)).
        weight: (H,) norm weight.
        eps: added to the mean of squares.

    Returns:
        (..., H) in the promoted dtype of weight and x (the activation dtype in the engine).
    """
    dtype = x.dtype
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    if weight.dtype == dtype:  # the engine's case: scaled in place, one (T, H) buffer less
        return normed.mul_(weight)
    return weight * normed


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: ``residual += x; out = rms_norm(residual)``.

    The sum is rounded to the activation dtype before the norm reads it, exactly like the
    unfused ``x = residual + x; rms_norm(x)``.

    Args:
        x: (..., H) the sublayer output to add.
        residual: (..., H) running residual stream, same dtype as x; updated IN PLACE.
        weight: (H,) norm weight.
        eps: added to the mean of squares.

    Returns:
        (out, residual): the normalized sum as a new tensor (dtype as in :func:`rms_norm_ref`),
        and ``residual`` itself, now holding ``residual + x``.
    """
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps), residual
