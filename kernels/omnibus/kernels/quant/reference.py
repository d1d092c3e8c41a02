"""W4A16: 4-bit weights times 16/32-bit activations, the torch reference.

A weight (out, in) is held as 4-bit codes q in [0, 15], two to a byte along the input
dimension (the even column in the low nibble, the odd one in the high nibble), with a
float32 scale and zero per output row and group of ``group`` input columns::

    w[n, k] = (q[n, k] - 8) * scales[n, k // group] + zeros[n, k // group]

(torch's own int4 kernels' convention: GPTQ/AWQ "(q - z) * s" weights map onto it with
zeros = (8 - z) * s). ``y = x @ w.T`` is computed in float32 and returned in x's dtype.
"""

from __future__ import annotations

import torch


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) uint8 codes 0..15 -> (out, in // 2) uint8, column 2j in the low nibble of
    byte j and column 2j + 1 in its high nibble."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4: q must be (out, in) with in even, got shape {tuple(q.shape)}")
    if q.dtype != torch.uint8:
        raise ValueError(f"pack_int4: q must be uint8 codes, got {q.dtype}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"pack_int4: codes must lie in 0..15, got a maximum of {int(q.max())}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in // 2) uint8 -> (out, in) uint8 codes 0..15; the inverse of :func:`pack_int4`."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed must be 2-D uint8, got shape {tuple(packed.shape)} "
                         f"{packed.dtype}")
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])


def check_int4_args(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
) -> None:
    """Raises ValueError, naming the shapes, unless the arguments of :func:`int4_matmul_ref`
    fit together: x (T, in), packed uint8 (out, in // 2), scales and zeros float32
    (out, in // group), in a multiple of group."""
    if x.dim() != 2 or packed.dim() != 2:
        raise ValueError(f"int4_matmul: x must be (T, in) and packed (out, in // 2), got x "
                         f"{tuple(x.shape)}, packed {tuple(packed.shape)}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"int4_matmul: packed must be uint8 (two codes a byte), got {packed.dtype}")
    in_dim, out_dim = x.shape[1], packed.shape[0]
    if group <= 0 or in_dim % group:
        raise ValueError(f"int4_matmul: in ({in_dim}, from x {tuple(x.shape)}) must be a multiple "
                         f"of group ({group})")
    if packed.shape[1] * 2 != in_dim:
        raise ValueError(f"int4_matmul: packed {tuple(packed.shape)} must be (out, in // 2) = "
                         f"({out_dim}, {in_dim / 2:g}) for x {tuple(x.shape)}")
    want = (out_dim, in_dim // group)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != want or t.dtype != torch.float32:
            raise ValueError(f"int4_matmul: {name} must be float32 (out, in // group) = {want} for "
                             f"packed {tuple(packed.shape)} and group {group}, got "
                             f"{tuple(t.shape)} {t.dtype}")


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """The (out, in) float32 weight that ``packed``, ``scales`` and ``zeros`` stand for."""
    q = unpack_int4(packed).float()  # (out, in)
    s = scales.repeat_interleave(group, dim=1)  # (out, in)
    z = zeros.repeat_interleave(group, dim=1)
    return (q - 8) * s + z


def int4_matmul_ref(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
) -> torch.Tensor:
    """``x @ w.T`` for the 4-bit weight w (see the module docstring).

    Args:
        x: (T, in) activations, float32, bfloat16 or float16.
        packed: (out, in // 2) uint8, two codes a byte (:func:`pack_int4`).
        scales, zeros: (out, in // group) float32.
        group: input columns per scale and zero; in must be a multiple of it.

    Returns:
        (T, out) in x's dtype, computed in float32.

    Raises:
        ValueError: the shapes do not fit together (:func:`check_int4_args`).
    """
    check_int4_args(x, packed, scales, zeros, group)
    w = dequantize_int4(packed, scales, zeros, group)  # (out, in) float32
    return (x.float() @ w.T).to(x.dtype)  # (T, out)
