"""Triton kernels at serving shapes on a CUDA device, in bf16 and fp16, against the float32
torch references (``make test-gpu``). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from omnibus.kernels.attention.reference import paged_attention_ref, store_kv_ref
from omnibus.kernels.fused.reference import rope_ref, silu_and_mul_ref
from omnibus.kernels.lora.reference import lora_expand_ref, lora_shrink_ref
from omnibus.kernels.norm.reference import add_rms_norm_ref, rms_norm_ref
from omnibus.kernels.quant.reference import int4_matmul_ref, pack_int4

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
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

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
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton

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
    from omnibus.kernels.attention.triton_kernels import store_kv_triton

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
def test_fp8_kv_cache_serving_batch(dtype: torch.dtype) -> None:
    """--kv-cache-dtype fp8: the store kernel writes what torch's saturated e4m3 cast of
    key / scale gives (random values: every rounding case, which the interpreter gets
    wrong), and attention over the FP8 cache with its scales equals the reference on the
    same cache."""
    from omnibus.kernels.attention.reference import to_cache_dtype
    from omnibus.kernels.attention.triton_kernels import paged_attention_triton, store_kv_triton

    fp8, k_scale, v_scale = torch.float8_e4m3fn, 0.02, 0.01
    num_tokens, num_blocks = 512, 64
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, device="cuda", dtype=fp8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE - BLOCK_SIZE, device="cuda")[:num_tokens] + BLOCK_SIZE
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype) * 4
    value = torch.randn_like(key) * 4
    store_kv_triton(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    flat_k, flat_v = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM), v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(flat_k[slots].view(torch.uint8), to_cache_dtype(key, fp8, k_scale).view(torch.uint8))
    assert torch.equal(flat_v[slots].view(torch.uint8), to_cache_dtype(value, fp8, v_scale).view(torch.uint8))

    specs = serving_specs(seed=2)
    q, k16, v16, block_tables, query_start_loc, seq_lens = make_batch(specs, dtype, 2)
    k8, v8 = to_cache_dtype(k16.nan_to_num(), fp8, k_scale), to_cache_dtype(v16.nan_to_num(), fp8, v_scale)
    scale = HEAD_DIM ** -0.5
    max_query_len = max(q_len for q_len, _ in specs)
    for partition_size in (None, 256):
        out = paged_attention_triton(q, k8, v8, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                                     partition_size=partition_size, k_scale=k_scale, v_scale=v_scale)
        ref = paged_attention_ref(q.float(), k8, v8, block_tables, query_start_loc, seq_lens, scale,
                                  k_scale=k_scale, v_scale=v_scale)
        assert out.dtype == dtype
        assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_rank", [16, 64])
def test_lora_serving_batch(dtype: torch.dtype, max_rank: int) -> None:
    from omnibus.kernels.lora.reference import lora_expand_triton, lora_shrink_triton

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


# ---------------------------------------------------------------------------------------------
# Fused elementwise kernels: RMSNorm (+ residual add), rotary embedding, SwiGLU
# ---------------------------------------------------------------------------------------------

HIDDEN, INTER, EPS, MAX_LEN = 4096, 14336, 1e-5, 8192
# Elements allowed to differ by one rounding step from the same-dtype reference, where only
# fp32 reduction order or exp/rsqrt ulps differ (a skipped rounding would differ far more).
MAX_DIFF_FRACTION = 1e-2


def diff_fraction(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out != ref).float().mean().item()


def rope_tables_cuda(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (MAX_LEN, D) cos/sin tables laid out as the engine's (half-duplicated)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(MAX_LEN, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1).cuda()
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 333, 4096])
def test_rms_norm_serving(dtype: torch.dtype, num_tokens: int) -> None:
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton, rms_norm_triton

    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(dtype)

    out = rms_norm_triton(x, weight, EPS)
    assert out.dtype == dtype
    assert rel_err(out, rms_norm_ref(x.float(), weight.float(), EPS)) < TOL
    assert diff_fraction(out, rms_norm_ref(x, weight, EPS)) < MAX_DIFF_FRACTION

    ref_out, ref_res = add_rms_norm_ref(x, residual.clone(), weight, EPS)
    out, new_residual = add_rms_norm_triton(x, residual, weight, EPS)
    assert new_residual is residual and torch.equal(residual, ref_res)
    assert diff_fraction(out, ref_out) < MAX_DIFF_FRACTION


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 333, 4096])
def test_rope_serving(dtype: torch.dtype, num_tokens: int) -> None:
    """In place on q/k views of a fused qkv output; bit-exact with the reference (the kernel
    rounds where it rounds, and no op there depends on libm)."""
    from omnibus.kernels.fused.triton_kernels import rope_triton

    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v_before = qkv[:, q_size + kv_size :].clone()
    cos, sin = rope_tables_cuda(HEAD_DIM)
    positions = torch.randint(0, MAX_LEN, (num_tokens,), device="cuda")
    q_ref, k_ref = rope_ref(q, k, cos, sin, positions)
    rope_triton(q, k, cos, sin, positions)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 333, 4096])
def test_silu_and_mul_serving(dtype: torch.dtype, num_tokens: int) -> None:
    from omnibus.kernels.fused.triton_kernels import silu_and_mul_triton

    gate_up = torch.randn(num_tokens, 2 * INTER, device="cuda", dtype=dtype)
    out = silu_and_mul_triton(gate_up)
    assert out.dtype == dtype and out.shape == (num_tokens, INTER)
    assert rel_err(out, silu_and_mul_ref(gate_up.float())) < TOL
    assert diff_fraction(out, silu_and_mul_ref(gate_up)) < MAX_DIFF_FRACTION


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_in_cuda_graph(dtype: torch.dtype) -> None:
    """The launchers read nothing back to the host: captured once, a replay equals eager."""
    from omnibus.kernels.fused.triton_kernels import rope_triton, silu_and_mul_triton
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton, rms_norm_triton

    num_tokens = 64
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    x = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device="cuda", dtype=dtype)
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    cos, sin = rope_tables_cuda(HEAD_DIM)
    positions = torch.randint(0, MAX_LEN, (num_tokens,), device="cuda")
    gate_up = torch.randn(num_tokens, 2 * INTER, device="cuda", dtype=dtype)
    residual0, qkv0 = residual.clone(), qkv.clone()

    def step() -> list[torch.Tensor]:
        normed = rms_norm_triton(x, weight, EPS)
        out, _ = add_rms_norm_triton(x, residual, weight, EPS)
        rope_triton(q, k, cos, sin, positions)
        return [normed, out, silu_and_mul_triton(gate_up)]

    def reset() -> None:  # undo the in-place updates
        residual.copy_(residual0)
        qkv.copy_(qkv0)

    step()  # compiles the kernels, which cannot happen during capture
    reset()
    expect = [t.clone() for t in step()] + [residual.clone(), qkv.clone()]
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    reset()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip([*outs, residual, qkv], expect):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# W4A16: 4-bit weights, bf16 activations
# ---------------------------------------------------------------------------------------------


def int4_weight(out_dim: int, in_dim: int, group: int) -> tuple[torch.Tensor, ...]:
    """(packed, scales, zeros) on CUDA: uniform codes, checkpoint-sized scales and zeros."""
    q = torch.randint(0, 16, (out_dim, in_dim), dtype=torch.uint8, device="cuda")
    scales = 0.002 + 0.01 * torch.rand(out_dim, in_dim // group, device="cuda")
    zeros = 0.005 * torch.randn(out_dim, in_dim // group, device="cuda")
    return pack_int4(q), scales, zeros


# (T, out, in, group): Llama-3-8B's q/o and gate/up shapes at decode (4096 x 4096 splits K)
# and prefill, group 128; group 32 once (three compiled variants in all).
INT4_CASES = [(t, n, 4096, 128) for t in (1, 16, 256) for n in (4096, 14336)] + [(16, 4096, 4096, 32)]


@pytest.mark.parametrize("num_tokens,out_dim,in_dim,group", INT4_CASES)
def test_int4_matmul_serving(num_tokens: int, out_dim: int, in_dim: int, group: int) -> None:
    """Bound as on the CPU (tests/kernels/test_kernels_quant.py): 2 bf16 ulps of the largest
    output, the kernel rounding each dequantized weight to bf16 for the tensor cores."""
    from omnibus.kernels.quant.triton_kernels import int4_matmul_triton

    torch.manual_seed(num_tokens + out_dim + group)
    packed, scales, zeros = int4_weight(out_dim, in_dim, group)
    x = torch.randn(num_tokens, in_dim, device="cuda", dtype=torch.bfloat16)
    out = int4_matmul_triton(x, packed, scales, zeros, group)
    ref = int4_matmul_ref(x, packed, scales, zeros, group)
    assert out.dtype == torch.bfloat16 and out.shape == (num_tokens, out_dim)
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err.item() < 2 * 2.0**-7


def test_int4_matmul_in_cuda_graph() -> None:
    """The launcher reads nothing back to the host (split-K included): a replay equals eager."""
    from omnibus.kernels.quant.triton_kernels import int4_matmul_triton

    packed, scales, zeros = int4_weight(4096, 4096, 128)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    expect = int4_matmul_triton(x, packed, scales, zeros, 128)  # compiles before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_matmul_triton(x, packed, scales, zeros, 128)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)
