"""Triton kernels for the paged KV cache: storing new tokens, and attention over a mixed batch.

Same semantics as :mod:`kernels.attention` (the torch reference). Attention is two kernels
launched over every sequence of the batch, each one skipping the sequences of the other, so
the host never has to look at the lengths (no device sync, CUDA-graph friendly):

- ``_extend_kernel``: sequences with several query tokens (full prefill, or a chunk after a
  cached prefix). One program per (sequence, tile of BLOCK_M query tokens, query head).
- ``_decode_kernel``: sequences with one query token. One program per (sequence, KV head,
  KV partition) handles all the query heads sharing that KV head, so each KV tile is read
  once per group. With several partitions (split-K, "flash decoding") each program writes an
  unnormalized partial output with its softmax max and sum, and ``_reduce_kernel`` merges
  the partitions by rescaling them to the global max (a log-sum-exp merge).

Only long-stable Triton features are used (load/store/dot/where/max/exp/sum, constexpr):
the code must run on triton 3.6 as well as 3.9. ``tl.dot`` needs every tile dim >= 16, so
head dim and GQA group tiles are padded to 16 with masked loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnibus.kernels._tiles import dot_precision, next_pow2, tile

# Decode KV partition length when split-K is chosen automatically.
_DEFAULT_PARTITION = 512
# Below this many (sequence, KV head) programs a GPU has idle SMs, and splitting the KV
# length adds parallelism worth the extra reduction pass.
_SPLIT_BELOW_PROGRAMS = 256
# Most KV partitions of one decode sequence. CUDA-graph buckets size the block table for
# max_model_len, so an uncapped split count follows it (256 partitions at 128k): the partial
# buffers grow with it, and the reduce program's (BLOCK_S, BLOCK_D) float32 tile (256 x 128
# over 4 warps) spills registers. Past the cap the partitions get longer instead.
MAX_SPLITS = 32


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    block_size, num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    k_inv_scale, v_inv_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    """One program per token: copies its (KVH, D) key and value into its slot (an FP8
    cache: times the layer's reciprocal scale and saturated, as `to_cache_dtype`)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    # Null-block and negative slots are padding tokens: nothing is written for them. (Scalar
    # conditions are folded into a bound: `tensor & scalar` masks break the interpreter.)
    mask = (h < tl.where(slot >= block_size, num_kv_heads, 0)) & (d < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h * stride_kch + d * stride_kcd
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d * stride_vcd
    if FP8:
        k = tl.clamp(k.to(tl.float32) * k_inv_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * v_inv_scale, -448.0, 448.0)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton version of :func:`kernels.attention.store_kv_ref` (same arguments)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], num_kv_heads, head_dim,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        1.0 / k_scale, 1.0 / v_scale,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


# ---------------------------------------------------------------------------------------------
# paged attention
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_row, offs_n, n_mask, offs_d, d_mask, kv_head,
    block_size, stride_btn,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
):
    """K tile transposed, (BLOCK_D, BLOCK_N), and V tile, (BLOCK_N, BLOCK_D), of key positions
    ``offs_n`` of one sequence (``block_row`` points at its block table row); zeros where
    masked, so no garbage slot is ever read."""
    # Per-token block lookup: any block_size works, including ones below BLOCK_N.
    block_ids = tl.load(block_row + (offs_n // block_size) * stride_btn, mask=n_mask, other=0)
    block_ids = block_ids.to(tl.int64)  # cache offsets can exceed 2**31
    in_block = offs_n % block_size
    k_rows = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh  # (BLOCK_N,)
    v_rows = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh
    k = tl.load(
        k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_kd,
        mask=n_mask[None, :] & d_mask[:, None], other=0.0,
    )
    v = tl.load(
        v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_vd,
        mask=n_mask[:, None] & d_mask[None, :], other=0.0,
    )
    return k, v


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr):
    """One online-softmax step in float32: folds the (rows, BLOCK_N) scores of this K/V tile
    into the running max ``m_i``, denominator ``l_i`` and unnormalized output ``acc``.
    A row needs a visible key in its first tile so that m_i is finite from then on."""
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale  # (rows, BLOCK_N)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, out_scale, block_size, num_queries_per_kv, head_dim,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Causal attention of BLOCK_M query tokens of one sequence, one query head."""
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // num_queries_per_kv

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached prefix before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index in the chunk
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    # Single-token sequences belong to the decode kernel.
    row_mask = offs_m < tl.where(q_len > 1, q_len, 0)
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    q_pos = context_len + offs_m  # (BLOCK_M,) absolute position of each query

    # Keys after the tile's last query are invisible to all its rows; an idle tile loops 0 times.
    active = (m_block * BLOCK_M < q_len) & (q_len > 1)
    kv_end = tl.where(active, tl.minimum(seq_len, context_len + (m_block + 1) * BLOCK_M), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_row = block_tables_ptr + seq * stride_btb
    # Every row (padding rows too) sees position 0, so the first tile sets a finite max.
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        n_mask = offs_n < kv_end
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_row, offs_n, n_mask, offs_d, d_mask, kv_head,
            block_size, stride_btn,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
        )
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]  # causal
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.0)  # idle tiles: avoid 0/0, nothing is stored anyway
    out = acc / l_i[:, None] * out_scale
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh
        + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, out_scale, block_size, num_queries_per_kv, head_dim, num_heads, partition_size, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_btb, stride_btn,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Attention of one decode token's query heads sharing one KV head, over one partition
    of the KV positions (the whole sequence when not SPLIT)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    is_decode = q_len == 1

    offs_g = tl.arange(0, BLOCK_G)  # (BLOCK_G,) query head within the group, padded to 16
    heads = kv_head * num_queries_per_kv + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_g < tl.where(is_decode, num_queries_per_kv, 0)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + q_start * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (BLOCK_G, BLOCK_D)

    kv_start = split * partition_size
    kv_end = tl.where(is_decode, tl.minimum(kv_start + partition_size, seq_len), kv_start)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_row = block_tables_ptr + seq * stride_btb
    # A partition past the sequence's end runs 0 iterations and leaves m_i = -inf, l_i = 0.
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_row, offs_n, n_mask, offs_d, d_mask, kv_head,
            block_size, stride_btn,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
        )
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale, DOT_PRECISION)

    if SPLIT:
        # Partials are (B, num_splits, H[, D]) float32, contiguous.
        part = (seq * num_splits + split) * num_heads + heads  # (BLOCK_G,)
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(
            part_acc_ptr + part[:, None] * head_dim + offs_d[None, :], acc,
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        l_i = tl.where(l_i > 0, l_i, 1.0)
        tl.store(
            out_ptr + q_start * stride_ot + heads[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            (acc / l_i[:, None] * out_scale).to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


@triton.jit
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, out_scale,
    head_dim, num_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merges one decode head's partition results: rescales each to the global max."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    is_decode = tl.load(query_start_loc_ptr + seq + 1) - q_start == 1

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < tl.where(is_decode, num_splits, 0)
    d_mask = offs_d < head_dim
    part = (seq * num_splits + offs_s) * num_heads + head  # (BLOCK_S,)
    m = tl.load(part_max_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # non-decode rows: keep exp finite
    w = tl.exp(m - m_max)  # empty partitions (m = -inf) weigh 0
    num = tl.sum(acc * w[:, None], 0)  # (BLOCK_D,)
    den = tl.sum(l * w, 0)
    den = tl.where(den > 0, den, 1.0)
    tl.store(
        out_ptr + q_start * stride_ot + head * stride_oh + offs_d * stride_od,
        (num / den * out_scale).to(out_ptr.dtype.element_ty),
        mask=offs_d < tl.where(is_decode, head_dim, 0),
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Triton version of :func:`kernels.attention.paged_attention_ref` (same arguments).

    Extra arguments:
        max_query_len: longest query chunk in the batch; pass it to avoid a device sync.
        out: optional (T, H, D) output; rows of no sequence are left untouched.
        partition_size: KV partition length of the split-K decode path. None picks split-K
            automatically (long contexts with too few programs to fill the GPU); a value
            forces it whenever the block table spans more than one partition.
    """
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = tile(head_dim, hi=1 << 16)
    # Larger head dims get narrower KV tiles to bound the registers held per program.
    block_n = 64 if head_dim <= 128 else 32
    precision = dot_precision(q.dtype, k_cache.dtype, v_cache.dtype)
    common = (block_size, group, head_dim)
    strides = (
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
    )

    if max_query_len > 1:
        block_m = tile(max_query_len)
        grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
        _extend_kernel[grid](
            q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
            scale * k_scale, v_scale, *common, *strides,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=precision,
        )

    # The block table width bounds every sequence's length without reading seq_lens.
    max_ctx = block_tables.shape[1] * block_size
    num_splits, partition = _plan_splits(num_seqs * num_kv_heads, max_ctx, partition_size)
    block_n = min(block_n, tile(partition))
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_splits, num_heads, head_dim, dtype=torch.float32,
                               device=q.device)
        part_max = torch.empty(num_seqs, num_splits, num_heads, dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused without SPLIT
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum,
        block_tables, query_start_loc, seq_lens,
        scale * k_scale, v_scale, *common, num_heads, partition, num_splits, *strides,
        BLOCK_G=tile(group, hi=1 << 16), BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=num_splits > 1,
        DOT_PRECISION=precision,
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, v_scale,
            head_dim, num_heads, num_splits, *out.stride(),
            BLOCK_S=tile(num_splits, lo=2, hi=1 << 16), BLOCK_D=block_d,
        )
    return out


def _plan_splits(num_programs: int, max_ctx: int, partition_size: int | None) -> tuple[int, int]:
    """(number of KV partitions, partition length) for the decode kernel; at most
    MAX_SPLITS partitions."""
    if partition_size is not None:
        if partition_size < 1:
            raise ValueError(f"partition_size must be positive, got {partition_size}")
    elif num_programs < _SPLIT_BELOW_PROGRAMS and max_ctx > 2 * _DEFAULT_PARTITION:
        partition_size = _DEFAULT_PARTITION
    else:
        return 1, max_ctx
    num_splits = triton.cdiv(max_ctx, partition_size)
    if num_splits > MAX_SPLITS:
        partition_size = triton.cdiv(max_ctx, MAX_SPLITS)
        num_splits = triton.cdiv(max_ctx, partition_size)
    return num_splits, partition_size
