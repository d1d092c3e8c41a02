"""Tile-size and dot-precision helpers shared by the Triton launchers (plain Python, no
Triton or torch import)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def tile(n: int, lo: int = 16, hi: int = 64) -> int:
    """Power-of-two tile covering ``n``, clamped to [lo, hi]; lo 16 is tl.dot's minimum."""
    return max(lo, min(hi, next_pow2(n)))


def dot_precision(*dtypes: object) -> str:
    """``tl.dot`` input precision for operands of these torch dtypes: "ieee" when any is
    float32. Triton's NVIDIA default ("tf32") rounds float32 operands to 10 mantissa bits,
    so a float32 engine would not match its float32 reference on a GPU (the interpreter
    always computes in plain float32 and cannot show it). 16-bit operands run on tensor
    cores at their own precision, which this setting does not change; they get "tf32",
    Triton's default."""
    return "ieee" if any(str(d) == "torch.float32" for d in dtypes) else "tf32"
