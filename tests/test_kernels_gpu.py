"""Triton kernels at serving shapes on a CUDA device, in bf16 and fp16, against the float32
torch references (``make test-gpu``). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_ref, store_kv_ref
from kernels.lora import lora_expand_ref, lora_shrink_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = [torch.bfloat16, torch.float16]
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(
    specs: list[tuple[int, int]], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) on CUDA, blocks shuffled.
    Unused slots hold NaN so that reading one shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // BLOCK_SIZE) for _, seq_len in specs]
    num_blocks = sum(blocks_per_seq) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    block_tables = torch.zeros(len(specs), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used : used + n]
        used += n
    for i, (_, seq_len) in enumerate(specs):
        pos = torch.arange(seq_len)
        blocks = block_tables[i, pos // BLOCK_SIZE].long().cuda()
        offsets = (pos % BLOCK_SIZE).cuda()
        k_cache[blocks, offsets] = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                                               dtype=dtype)
        v_cache[blocks, offsets] = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                                               dtype=dtype)
    q_lens = torch.tensor([q_len for q_len, _ in specs])
    query_start_loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    q = torch.randn(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    seq_lens = torch.tensor([seq_len for _, seq_len in specs], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables.cuda(), query_start_loc.cuda(), seq_lens.cuda()


def serving_specs(seed: int) -> list[tuple[int, int]]:
    """64 sequences: decodes with contexts up to 4096, chunked prefills after a cached
    prefix, and full prefills, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(1, int(n)) for n in torch.randint(1, 4097, (56,), generator=gen)]
    specs += [(256, 1024), (512, 4096), (100, 2000), (37, 37), (512, 512), (1000, 1000),
              (2, 17), (16, 16)]
    return [specs[i] for i in torch.randperm(len(specs), generator=gen)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partition_size", [None, 256])
def test_paged_attention_serving_batch(dtype: torch.dtype, partition_size: int | None) -> None:
    from kernels.attention_triton import paged_attention_triton

    specs = serving_specs(seed=0)
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens = make_batch(specs, dtype, 0)
    scale = HEAD_DIM ** -0.5
    max_query_len = max(q_len for q_len, _ in specs)
    out = paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 scale, max_query_len, partition_size=partition_size)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                              query_start_loc, seq_lens, scale)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_few_long_decodes(dtype: torch.dtype) -> None:
    """Few sequences with long contexts: the automatic split-K path."""
    from kernels.attention_triton import paged_attention_triton

    specs = [(1, 4096), (1, 3000), (1, 4095), (1, 17)]
    q, k_cache, v_cache, block_tables, query_start_loc, seq_lens = make_batch(specs, dtype, 1)
    scale = HEAD_DIM ** -0.5
    out = paged_attention_triton(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                 scale, 1)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables,
                              query_start_loc, seq_lens, scale)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype: torch.dtype) -> None:
    from kernels.attention_triton import store_kv_triton

    num_tokens, num_blocks = 512, 64
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=dtype)
    v_cache = torch.randn(shape, device="cuda", dtype=dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    slots[::7] = -1  # padding tokens
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, expect_k, expect_v, slots)
    store_kv_triton(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_rank", [16, 64])
def test_lora_serving_batch(dtype: torch.dtype, max_rank: int) -> None:
    from kernels.lora import lora_expand_triton, lora_shrink_triton

    in_dim, out_dim, num_slots = 4096, 4096, 4
    gen = torch.Generator().manual_seed(max_rank)
    seg_lens = [1] * 40 + [300, 1, 17, 512]
    seg_slots = (torch.randint(-1, num_slots, (len(seg_lens),), generator=gen)).int().cuda()
    seg_starts = torch.zeros(len(seg_lens) + 1, dtype=torch.int32)
    seg_starts[1:] = torch.tensor(seg_lens).cumsum(0)
    seg_starts = seg_starts.cuda()
    num_tokens = sum(seg_lens)
    x = torch.randn(num_tokens, in_dim, device="cuda", dtype=dtype)
    lora_a = torch.zeros(num_slots, max_rank, in_dim, device="cuda", dtype=dtype)
    lora_b = torch.zeros(num_slots, out_dim, max_rank, device="cuda", dtype=dtype)
    for slot in range(num_slots):
        rank = max_rank >> slot % 3  # true ranks below max_rank, zero-padded
        lora_a[slot, :rank] = torch.randn(rank, in_dim, device="cuda", dtype=dtype) * 0.02
        lora_b[slot, :, :rank] = torch.randn(out_dim, rank, device="cuda", dtype=dtype) * 0.02
    scales = torch.rand(num_slots, device="cuda") + 0.5

    y = lora_shrink_triton(x, lora_a, seg_starts, seg_slots)
    y_ref = lora_shrink_ref(x.float(), lora_a.float(), seg_starts, seg_slots)
    assert rel_err(y, y_ref) < TOL

    # A small base keeps bf16 rounding of (base + delta) well below the delta itself.
    base = 0.01 * torch.randn(num_tokens, out_dim, device="cuda", dtype=dtype)
    out = base.clone()
    lora_expand_triton(y_ref, lora_b, seg_starts, seg_slots, scales, out)
    delta_ref = torch.zeros(num_tokens, out_dim, device="cuda")
    lora_expand_ref(y_ref, lora_b.float(), seg_starts, seg_slots, scales, delta_ref)
    assert rel_err(out.float() - base.float(), delta_ref) < TOL
