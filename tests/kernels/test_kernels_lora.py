"""Multi-LoRA shrink/expand: the torch reference and the Triton kernels (interpreter on CPU)
against a per-token loop."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from omnibus.kernels.lora.reference import lora_expand_ref, lora_shrink_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
IN_DIM, OUT_DIM = 150, 80  # > one K tile (128) and > one N tile (64), neither a power of 2

# (tokens, adapter slot): lengths 1 and longer than a 16-token tile, no-adapter segments,
# adapters appearing in several segments.
SEGMENTS = [(1, 0), (5, -1), (3, 2), (1, 1), (18, 0), (1, -1), (7, 1), (2, 2)]


@dataclass
class LoraBatch:
    x: torch.Tensor  # (T, IN_DIM)
    lora_a: torch.Tensor  # (num_slots, max_rank, IN_DIM), rows past each true rank zero
    lora_b: torch.Tensor  # (num_slots, OUT_DIM, max_rank), columns past each true rank zero
    scales: torch.Tensor  # float32 (num_slots,)
    seg_starts: torch.Tensor  # int32 (S + 1,)
    seg_slots: torch.Tensor  # int32 (S,)

    def token_slots(self) -> list[int]:
        return [slot for n, slot in SEGMENTS for _ in range(n)]


def make_lora_batch(ranks: list[int], max_rank: int, seed: int) -> LoraBatch:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(n for n, _ in SEGMENTS)
    lora_a = torch.zeros(len(ranks), max_rank, IN_DIM)
    lora_b = torch.zeros(len(ranks), OUT_DIM, max_rank)
    for slot, rank in enumerate(ranks):
        lora_a[slot, :rank] = torch.randn(rank, IN_DIM, generator=gen)
        lora_b[slot, :, :rank] = torch.randn(OUT_DIM, rank, generator=gen)
    seg_starts = torch.zeros(len(SEGMENTS) + 1, dtype=torch.int32)
    seg_starts[1:] = torch.tensor([n for n, _ in SEGMENTS]).cumsum(0)
    return LoraBatch(
        x=torch.randn(num_tokens, IN_DIM, generator=gen),
        lora_a=lora_a,
        lora_b=lora_b,
        scales=torch.rand(len(ranks), generator=gen) + 0.5,
        seg_starts=seg_starts,
        seg_slots=torch.tensor([slot for _, slot in SEGMENTS], dtype=torch.int32),
    )


def loop_shrink(b: LoraBatch) -> torch.Tensor:
    y = torch.zeros(b.x.shape[0], b.lora_a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(b.token_slots()):
        if slot >= 0:
            y[t] = b.lora_a[slot].double() @ b.x[t].double()
    return y


def loop_expand(b: LoraBatch, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    expected = out.double()
    for t, slot in enumerate(b.token_slots()):
        if slot >= 0:
            expected[t] += b.scales[slot].double() * (b.lora_b[slot].double() @ y[t].double())
    return expected


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _impls() -> list[Any]:
    impls: list[Any] = [pytest.param("ref", id="ref")]
    if HAS_TRITON:
        impls.append(pytest.param("triton", id="triton"))
    return impls


def _shrink(impl: str) -> Callable[..., torch.Tensor]:
    if impl == "ref":
        return lora_shrink_ref
    from omnibus.kernels.lora.reference import lora_shrink_triton

    def shrink(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        # Poisoned output: every token of every segment must be written (zeros for -1).
        out = torch.full((x.shape[0], args[0].shape[1]), float("nan"))
        return lora_shrink_triton(x, *args, out=out)

    return shrink


def _expand(impl: str) -> Callable[..., None]:
    if impl == "ref":
        return lora_expand_ref
    from omnibus.kernels.lora.reference import lora_expand_triton

    return lora_expand_triton


# max_rank 8: below tl.dot's 16, padded in the kernel; 24: not a power of 2.
RANK_CASES = [([2, 5, 8], 8), ([4, 16, 24], 24)]


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("ranks,max_rank", RANK_CASES)
def test_shrink(impl: str, ranks: list[int], max_rank: int) -> None:
    b = make_lora_batch(ranks, max_rank, seed=max_rank)
    y = _shrink(impl)(b.x, b.lora_a, b.seg_starts, b.seg_slots)
    assert y.dtype == torch.float32 and y.shape == (b.x.shape[0], max_rank)
    expected = loop_shrink(b)
    no_adapter = torch.tensor(b.token_slots()) < 0
    assert torch.all(y[no_adapter] == 0)
    assert rel_err(y, expected) < 1e-5


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("ranks,max_rank", RANK_CASES)
def test_expand(impl: str, ranks: list[int], max_rank: int) -> None:
    b = make_lora_batch(ranks, max_rank, seed=100 + max_rank)
    y = loop_shrink(b).float()
    out = torch.randn(b.x.shape[0], OUT_DIM)
    before = out.clone()
    _expand(impl)(y, b.lora_b, b.seg_starts, b.seg_slots, b.scales, out)
    no_adapter = torch.tensor(b.token_slots()) < 0
    assert torch.equal(out[no_adapter], before[no_adapter])
    assert rel_err(out, loop_expand(b, y, before)) < 1e-5


@pytest.mark.parametrize("impl", _impls())
def test_expand_into_column_slice(impl: str) -> None:
    """out as a column slice of a fused projection output: the rest stays untouched."""
    b = make_lora_batch([4, 8, 8], 8, seed=7)
    y = loop_shrink(b).float()
    fused = torch.randn(b.x.shape[0], OUT_DIM + 32)
    before = fused.clone()
    _expand(impl)(y, b.lora_b, b.seg_starts, b.seg_slots, b.scales, fused[:, 16 : 16 + OUT_DIM])
    assert torch.equal(fused[:, :16], before[:, :16])
    assert torch.equal(fused[:, 16 + OUT_DIM :], before[:, 16 + OUT_DIM :])
    expected = loop_expand(b, y, before[:, 16 : 16 + OUT_DIM])
    assert rel_err(fused[:, 16 : 16 + OUT_DIM], expected) < 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_dispatch_forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatchers agree with the reference whichever way they route."""
    from omnibus import kernels

    b = make_lora_batch([2, 5, 8], 8, seed=9)
    for force in ("0", "1"):
        monkeypatch.setenv("OMNIBUS_FORCE_TRITON", force)
        y = kernels.lora_shrink(b.x, b.lora_a, b.seg_starts, b.seg_slots)
        assert rel_err(y, loop_shrink(b)) < 1e-5
        out = torch.zeros(b.x.shape[0], OUT_DIM)
        kernels.lora_expand(y, b.lora_b, b.seg_starts, b.seg_slots, b.scales, out)
        assert rel_err(out, loop_expand(b, y, torch.zeros_like(out))) < 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_grid_sized_by_longest_segment_and_idle_tiles_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatchers forward max_seg_len: the grid's token-tile axis covers the longest
    segment (18 tokens: 2 tiles of 16), not all 38 tokens (3 tiles); and expand tiles past
    their segment's end or without adapter exit before their dot (issue #17, defect 3)."""
    from omnibus import kernels
    from omnibus.kernels.lora import triton_kernels as lora_triton
    from tests.kernels.launches import count_dots, record_launches

    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    b = make_lora_batch([2, 5, 8], 8, seed=11)
    longest = max(n for n, _ in SEGMENTS)
    shrinks = record_launches(monkeypatch, lora_triton, "_shrink_kernel")
    expands = record_launches(monkeypatch, lora_triton, "_expand_kernel")
    y = kernels.lora_shrink(b.x, b.lora_a, b.seg_starts, b.seg_slots, max_seg_len=longest)
    out = torch.zeros(b.x.shape[0], OUT_DIM)
    dots = count_dots(monkeypatch)
    kernels.lora_expand(y, b.lora_b, b.seg_starts, b.seg_slots, b.scales, out, max_seg_len=longest)
    # (segments, token tiles, N tiles of 64 over 80 columns); rank 8 is one reduction tile
    assert [launch.grid for launch in expands] == [(len(SEGMENTS), 2, 2)]
    assert [launch.grid[:2] for launch in shrinks] == [(len(SEGMENTS), 2)]
    # Only tiles holding adapter tokens compute: one per adapter segment, two for the
    # 18-token one, times 2 N tiles: 7 * 2 of the 32 programs.
    assert dots[0] == 14
    assert rel_err(out, loop_expand(b, y, torch.zeros_like(out))) < 1e-5
