"""Paged KV cache: the torch reference against plain dense causal attention in float64, and
the Triton kernels (run by the interpreter on CPU) against the reference.

Every cache slot that holds no real token is NaN: the null block, unused blocks and the tail
of each sequence's last block. Any read of garbage therefore shows up in the output.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from omnibus import kernels
from omnibus.kernels.attention.reference import (
    paged_attention_ref,
    plan_attention_ref,
    store_kv_ref,
    to_cache_dtype,
)

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

NUM_KV_HEADS = 2


@dataclass
class PagedBatch:
    """A packed batch of sequences whose K/V already sit in a paged cache."""

    specs: list[tuple[int, int]]  # (q_len, seq_len) per sequence
    q: torch.Tensor  # (T, H, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, KVH, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 (B, max_blocks)
    query_start_loc: torch.Tensor  # int32 (B + 1,)
    seq_lens: torch.Tensor  # int32 (B,)

    @property
    def max_query_len(self) -> int:
        return max(q_len for q_len, _ in self.specs)

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_batch(
    specs: list[tuple[int, int]],
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """Random batch; blocks are handed out in shuffled order, a few are left unused."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 4  # null block + 3 unused
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(specs), max(blocks_per_seq), dtype=torch.int32)
    for i, (_, seq_len) in enumerate(specs):
        block_tables[i, : blocks_per_seq[i]] = torch.tensor(free[: blocks_per_seq[i]])
        del free[: blocks_per_seq[i]]
        pos = torch.arange(seq_len)
        blocks = block_tables[i, pos // block_size].long()
        kv_shape = (seq_len, NUM_KV_HEADS, head_dim)
        k_cache[blocks, pos % block_size] = _randn(gen, *kv_shape, dtype=dtype)
        v_cache[blocks, pos % block_size] = _randn(gen, *kv_shape, dtype=dtype)
    q_lens = torch.tensor([q_len for q_len, _ in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    num_tokens = int(q_lens.sum())
    q = _randn(gen, num_tokens, NUM_KV_HEADS * group, head_dim, dtype=dtype)
    seq_lens = torch.tensor([seq_len for _, seq_len in specs], dtype=torch.int32)
    return PagedBatch(specs, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def dense_attention(b: PagedBatch) -> torch.Tensor:
    """Plain causal attention per sequence, float64, reading the cache slot by slot."""
    block_size = b.k_cache.shape[1]
    group = b.q.shape[1] // NUM_KV_HEADS
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    for i, (q_len, seq_len) in enumerate(b.specs):
        pos = torch.arange(seq_len)
        blocks = b.block_tables[i, pos // block_size].long()
        # (L, H, D): KV head h // group serves query head h
        k = b.k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = b.v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        start = int(b.query_start_loc[i])
        q = b.q[start : start + q_len].double()  # (Q, H, D)
        scores = torch.einsum("qhd,lhd->hql", q, k) * b.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        scores[:, pos[None, :] > q_pos[:, None]] = float("-inf")
        out[start : start + q_len] = torch.einsum("hql,lhd->qhd", scores.softmax(-1), v)
    return out


def mixed_specs(bs: int) -> list[tuple[int, int]]:
    """Decodes, chunks after a cached prefix and full prefills, interleaved, with lengths on
    and around block boundaries and a few spanning several 64-key kernel tiles."""
    return [
        (1, bs + 1), (5, 2 * bs + 5), (2 * bs, 2 * bs), (1, 1), (1, bs), (1, bs - 1),
        (bs - 1, bs - 1), (3, 2 * bs - 1), (1, 4 * bs - 1), (9, 5 * bs), (1, 130), (20, 100),
    ]


# (GQA group, head_dim, block_size): GQA ratios 1, 4 and 8; a head dim that is no power of 2.
LAYOUTS = [(1, 16, 8), (4, 24, 16), (8, 16, 8)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("group,head_dim,block_size", LAYOUTS)
@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_reference_matches_dense(kind: str, group: int, head_dim: int, block_size: int) -> None:
    specs = mixed_specs(block_size)
    if kind == "decode":
        specs = [s for s in specs if s[0] == 1]
    elif kind == "prefill":
        specs = [s for s in specs if s[0] > 1]
    b = make_batch(specs, group, head_dim, block_size, seed=group + block_size)
    out = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale, b.max_query_len)
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    assert rel_err(out, dense_attention(b)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_low_precision(dtype: torch.dtype) -> None:
    b = make_batch(mixed_specs(8), 4, 16, 8, seed=3, dtype=dtype)
    out = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    assert out.dtype == dtype
    assert rel_err(out, dense_attention(b)) < 1e-2


def test_reference_leaves_unused_rows_of_out() -> None:
    """Rows past the last sequence (e.g. CUDA-graph padding) are not written."""
    b = make_batch([(1, 9), (3, 3)], 1, 16, 8, seed=4)
    out = torch.full((b.q.shape[0] + 2, *b.q.shape[1:]), 7.0)
    q = torch.cat([b.q, torch.zeros(2, *b.q.shape[1:])])
    paged_attention_ref(q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                        b.seq_lens, b.scale, out=out)
    assert torch.all(out[-2:] == 7.0)
    assert rel_err(out[:-2], dense_attention(b)) < 1e-5


def decode_specs(bs: int) -> list[tuple[int, int]]:
    """Ragged decodes: lengths 1, on and around block boundaries, and several blocks long."""
    return [(1, n) for n in (1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs - 1, 5 * bs, 7, 4 * bs + 3)]


def _stale_tables(b: PagedBatch) -> None:
    """Point the unused block-table entries (null block 0) at unused NaN blocks instead:
    stale ids left by a freed sequence must not be read either."""
    used = set(b.block_tables.flatten().tolist()) - {0}
    spare = [i for i in range(1, b.k_cache.shape[0]) if i not in used]
    b.block_tables[b.block_tables == 0] = spare[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group,head_dim,block_size", LAYOUTS)
@pytest.mark.parametrize("kind", ["decode", "short-decode", "mixed"])
def test_reference_decode_chunks(
    monkeypatch: pytest.MonkeyPatch, kind: str, group: int, head_dim: int, block_size: int,
    dtype: torch.dtype,
) -> None:
    """The batched decode path against the per-sequence dense loop: chunks forced small (so
    chunks of different widths and single-sequence chunks occur), stale table entries,
    decodes that all fit one block ("short-decode"), decodes among prefills, into ``out``."""
    from omnibus.kernels.attention import reference

    specs = {
        "decode": decode_specs(block_size),
        "short-decode": [(1, 1), (1, block_size), (1, 3), (1, block_size - 1)],
        "mixed": [s for pair in zip(decode_specs(block_size), mixed_specs(block_size))
                  for s in pair],
    }[kind]
    row_bytes = NUM_KV_HEADS * head_dim * 4
    monkeypatch.setattr(reference, "_CHUNK_BYTES", 3 * block_size * row_bytes)
    b = make_batch(specs, group, head_dim, block_size, seed=block_size + group, dtype=dtype)
    _stale_tables(b)
    out = torch.full_like(b.q, float("nan"))
    got = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale, out=out)
    assert got is out and not out.isnan().any()
    assert rel_err(out, dense_attention(b)) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_reference_plan_is_shared_by_layers() -> None:
    """One plan_attention_ref serves every layer of a step: two layers' caches and queries
    give what each call planning for itself gives, and store_kv_ref with the plan writes
    the same slots as without (padding slots skipped)."""
    specs = [s for pair in zip(decode_specs(8), mixed_specs(8)) for s in pair]
    b = make_batch(specs, 4, 16, 8, seed=20)
    # A second layer: its own queries and K/V in the same blocks (NaN where there is none).
    layers = [b, replace(b, q=torch.randn_like(b.q), k_cache=b.k_cache * 0.5 + 1, v_cache=-b.v_cache)]
    slots = torch.arange(b.q.shape[0]) + 8
    slots[::5] = -1  # padding tokens
    plan = plan_attention_ref(b.k_cache, b.block_tables, b.query_start_loc, b.seq_lens, slots)
    for layer in layers:
        args = (layer.q, layer.k_cache, layer.v_cache, layer.block_tables,
                layer.query_start_loc, layer.seq_lens, layer.scale)
        assert torch.equal(paged_attention_ref(*args, plan=plan), paged_attention_ref(*args))
        key, value = torch.randn(2, *layer.q.shape[:1], NUM_KV_HEADS, 16).unbind(0)
        caches = [(layer.k_cache.clone(), layer.v_cache.clone()) for _ in range(2)]
        caches.append((layer.k_cache.clone(), layer.v_cache.clone()))
        store_kv_ref(key, value, *caches[0], slots, plan)
        store_kv_ref(key, value, *caches[1], slots)
        # A plan made for the attention alone (no slots) leaves the store to work them out.
        attention_only = plan_attention_ref(b.k_cache, b.block_tables, b.query_start_loc, b.seq_lens)
        store_kv_ref(key, value, *caches[2], slots, attention_only)
        for other in caches[1:]:
            for got, want in zip(caches[0], other):
                assert torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_triton
@pytest.mark.parametrize("group,head_dim,block_size", LAYOUTS)
def test_triton_matches_reference(group: int, head_dim: int, block_size: int) -> None:
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

    b = make_batch(mixed_specs(block_size), group, head_dim, block_size, seed=10 + group)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                           b.seq_lens, b.scale, b.max_query_len, out=out)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-4


@needs_triton
@pytest.mark.parametrize("kind,partition_size", [("decode", 16), ("decode", 40), ("mixed", 16)])
def test_triton_split_k(kind: str, partition_size: int) -> None:
    """Split-K decode forced by a small partition (40: partitions not aligned to the key
    tile). Partitions past a short sequence's end are empty and must weigh nothing."""
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

    specs = [s for s in mixed_specs(8) if kind == "mixed" or s[0] == 1]
    b = make_batch(specs, 4, 16, 8, seed=partition_size)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                           b.seq_lens, b.scale, b.max_query_len, out=out,
                           partition_size=partition_size)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-4


@needs_triton
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_triton_single_kind_batches(kind: str) -> None:
    """Decode-only (the extend kernel is not launched) and prefill-only batches (every decode
    program idles), the latter without max_query_len (read from the device)."""
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

    keep = (lambda s: s[0] == 1) if kind == "decode" else (lambda s: s[0] > 1)
    b = make_batch([s for s in mixed_specs(8) if keep(s)], 4, 16, 8, seed=21)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    out = torch.full_like(b.q, float("nan"))
    max_query_len = 1 if kind == "decode" else None
    paged_attention_triton(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                           b.seq_lens, b.scale, max_query_len, out=out)
    assert rel_err(out, ref) < 1e-4


@needs_triton
def test_triton_strided_query() -> None:
    """q as a column slice of a fused qkv projection output (non-contiguous rows)."""
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

    b = make_batch(mixed_specs(8)[:6], 4, 16, 8, seed=5)
    num_tokens, num_heads, head_dim = b.q.shape
    fused = torch.randn(num_tokens, 2 * num_heads, head_dim)
    fused[:, :num_heads] = b.q
    q = fused[:, :num_heads]
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    out = paged_attention_triton(q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                                 b.seq_lens, b.scale, b.max_query_len)
    assert rel_err(out, ref) < 1e-4


def _store_fns() -> list[Any]:
    fns: list[Any] = [pytest.param(store_kv_ref, id="ref")]
    if importlib.util.find_spec("triton") is not None:
        from omnibus.kernels.attention.triton_kernels import store_kv_triton

        fns.append(pytest.param(store_kv_triton, id="triton"))
    return fns


@pytest.mark.parametrize("store", _store_fns())
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv(store: Callable[..., None], head_dim: int, contiguous: bool) -> None:
    """Real slots are written; null-block (< block_size) and negative slots are skipped;
    through a strided cache (a view of a wider one) too."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks = 8, 6
    heads = NUM_KV_HEADS if contiguous else 2 * NUM_KV_HEADS
    k_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)[:, :, :NUM_KV_HEADS]
    v_cache = torch.randn(num_blocks, block_size, heads, head_dim, generator=gen)[:, :, :NUM_KV_HEADS]
    assert k_cache.is_contiguous() == contiguous
    real = torch.randperm(num_blocks * block_size - block_size, generator=gen)[:9] + block_size
    padding = torch.tensor([0, block_size - 1, -1, 3, -7])
    slot_mapping = torch.cat([real[:4], padding[:3], real[4:], padding[3:]])[
        torch.randperm(14, generator=gen)
    ]
    key = torch.randn(14, NUM_KV_HEADS, head_dim, generator=gen)
    value = torch.randn(14, NUM_KV_HEADS, head_dim, generator=gen)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= block_size:
            expect_k[slot // block_size, slot % block_size] = key[t]
            expect_v[slot // block_size, slot % block_size] = value[t]
    store(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


@needs_triton
def test_dispatch_forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """OMNIBUS_FORCE_TRITON=1 routes CPU tensors to the Triton kernels."""
    from omnibus.kernels.attention import triton_kernels as attention_triton

    calls: list[str] = []
    real = attention_triton.paged_attention_triton

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("triton")
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_triton, "paged_attention_triton", spy)
    b = make_batch([(1, 9), (4, 12)], 1, 16, 8, seed=6)
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale)
    monkeypatch.delenv("OMNIBUS_FORCE_TRITON", raising=False)
    ref = kernels.paged_attention(*args)
    assert calls == []
    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    out = kernels.paged_attention(*args, b.max_query_len)
    assert calls == ["triton"]
    assert rel_err(out, ref) < 1e-4


@needs_triton
def test_split_count_is_capped() -> None:
    """A CUDA-graph bucket's block table spans max_model_len: at 128k and a few programs the
    decode split-K used 256 partitions of 512; it is capped at MAX_SPLITS longer ones
    (issue #17, defect 6)."""
    from omnibus.kernels.attention.triton_kernels import MAX_SPLITS, _plan_splits

    assert MAX_SPLITS == 32
    assert _plan_splits(8, 131072, None) == (32, 4096)
    assert _plan_splits(8, 8192, None) == (16, 512)  # under the cap: unchanged
    assert _plan_splits(8, 1000, 16) == (32, 32)  # a forced partition is lengthened too
    assert _plan_splits(512, 131072, None) == (1, 131072)  # enough programs: no split


@needs_triton
def test_triton_split_k_reduces_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partition 8 over a 600-position table would be 75 partitions: the kernel runs 32 of
    19 positions, the reduction merges all 32 (sequences spanning every partition, and one
    ending in the middle), and the output matches the reference."""
    from omnibus.kernels.attention import triton_kernels as attention_triton
    from tests.kernels.launches import record_launches

    decodes = record_launches(monkeypatch, attention_triton, "_decode_kernel")
    reduces = record_launches(monkeypatch, attention_triton, "_reduce_kernel")
    b = make_batch([(1, 600), (1, 333)], 2, 16, 8, seed=17)
    ref = paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc,
                              b.seq_lens, b.scale)
    out = attention_triton.paged_attention_triton(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale, 1,
        partition_size=8)
    assert [launch.grid for launch in decodes] == [(2, NUM_KV_HEADS, 32)]
    assert [(launch.grid, launch.kwargs["BLOCK_S"]) for launch in reduces] == [((2, 4), 32)]
    assert rel_err(out, ref) < 1e-4


# --- FP8 caches (--kv-cache-dtype fp8) ----------------------------------------------------------

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.02, 0.01


def fp8_batch(b: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`b`'s caches as an FP8 cache stores them (garbage slots zero: FP8 has no NaN to spare)."""
    return (to_cache_dtype(b.k_cache.nan_to_num(), FP8, K_SCALE),
            to_cache_dtype(b.v_cache.nan_to_num(), FP8, V_SCALE))


def test_reference_reads_an_fp8_cache_as_its_dequantized_values() -> None:
    """Attention over an FP8 cache with scales is attention over the cache's values times
    them (the key scale folded into the softmax scale, the value scale into the output)."""
    b = make_batch(mixed_specs(8), 4, 16, 8, seed=3)
    k8, v8 = fp8_batch(b)
    got = paged_attention_ref(b.q, k8, v8, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
                              k_scale=K_SCALE, v_scale=V_SCALE)
    deq = replace(b, k_cache=k8.float() * K_SCALE, v_cache=v8.float() * V_SCALE)
    assert rel_err(got, dense_attention(deq)) < 1e-5
    # what the format costs against the float32 cache: e4m3's 3 mantissa bits (measured 0.031)
    assert rel_err(got, dense_attention(b)) < 0.06


@needs_triton
@pytest.mark.parametrize("partition_size", [None, 16])
def test_triton_reads_an_fp8_cache_as_the_reference(partition_size: int | None) -> None:
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

    b = make_batch(mixed_specs(8), 4, 16, 8, seed=3)
    k8, v8 = fp8_batch(b)
    ref = paged_attention_ref(b.q, k8, v8, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
                              k_scale=K_SCALE, v_scale=V_SCALE)
    out = torch.full_like(b.q, float("nan"))
    paged_attention_triton(b.q, k8, v8, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
                           b.max_query_len, out=out, partition_size=partition_size,
                           k_scale=K_SCALE, v_scale=V_SCALE)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-4


@pytest.mark.parametrize("store", _store_fns())
def test_store_kv_into_fp8_divides_by_the_scale_and_saturates(store: Callable[..., None]) -> None:
    """Keys and values are stored divided by their scales, in e4m3, saturated at +-448.
    The inputs are FP8 values times the scale (plus out-of-range ones): the Triton
    interpreter's float32 -> e4m3 cast drops the carry of a mantissa that rounds up into the
    next power of two (124.0 -> 64.0; torch and the GPU give 128.0), so values that round
    are left to the GPU check."""
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.zeros(6, 8, NUM_KV_HEADS, 16, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    codes = torch.randn(5, NUM_KV_HEADS, 16, generator=gen).mul(60).to(FP8).float()
    key, value = codes * K_SCALE, codes.flip(0) * V_SCALE
    key[0, 0, 0], value[1, 1, 1] = 1000.0, -1e6  # beyond e4m3's range: saturated
    slots = torch.tensor([8, 9, 20, 3, 47])  # 3: the null block, skipped
    store(key, value, k_cache, v_cache, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    for t, slot in enumerate(slots.tolist()):
        got_k, got_v = k_cache[slot // 8, slot % 8].float(), v_cache[slot // 8, slot % 8].float()
        if slot < 8:
            assert not got_k.any() and not got_v.any()
            continue
        want_k, want_v = codes[t].clone(), codes.flip(0)[t].clone()
        if t == 0:
            want_k[0, 0] = 448.0
        if t == 1:
            want_v[1, 1] = -448.0
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), t
