"""Tile-size helpers shared by the Triton launchers (plain Python, no Triton import)."""

from __future__ import annotations


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def tile(n: int, lo: int = 16, hi: int = 64) -> int:
    """Power-of-two tile covering ``n``, clamped to [lo, hi]; lo 16 is tl.dot's minimum."""
    return max(lo, min(hi, next_pow2(n)))
