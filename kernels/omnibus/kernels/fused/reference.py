"""Rotary embedding and the SwiGLU activation in plain PyTorch: the references for the Triton
kernels (:mod:`kernels.fused_triton`) and the engine's CPU path.

Both reproduce the engine's (and transformers') math bit for bit, roundings included: rope
casts the cos/sin rows to the activation dtype before multiplying, and every op rounds to
that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of each token's query and key heads by its position (neox layout:
    dim d pairs with d + D/2).

    Args:
        q: (T, H, D) queries; D even.
        k: (T, KVH, D) keys, same dtype as q.
        cos_table, sin_table: float32 (max_len, D), half-duplicated (``cat(freqs, freqs)``).
        positions: int64 (T,) position of each token, in any order.

    Returns:
        (q_rot, k_rot): new tensors of q's and k's shapes, in q's dtype.
    """
    cos = cos_table[positions].to(q.dtype)[:, None, :]  # (T, 1, D)
    sin = sin_table[positions].to(q.dtype)[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' op order, so the same bits) with
    the products and the sum written into two buffers instead of five."""
    half = x.shape[-1] // 2
    rotated = torch.empty_like(x)  # rotate_half(x): (-x2, x1)
    torch.neg(x[..., half:], out=rotated[..., :half])
    rotated[..., half:] = x[..., :half]
    return (x * cos).add_(rotated.mul_(sin))


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused gate/up projection output.

    Args:
        gate_up: (T, 2I), gate in the first I columns, up in the last I.

    Returns:
        (T, I) ``silu(gate) * up`` in gate_up's dtype.
    """
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one (T, I) buffer, not two
