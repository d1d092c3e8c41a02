"""Paged KV-cache attention in plain PyTorch: the reference for the Triton kernels and the
engine's CPU path.

Cache layout (per layer): ``k_cache``/``v_cache`` of shape (num_blocks, block_size, KVH, D).
A token's slot is ``block_id * block_size + offset``; block 0 is a reserved null block whose
content is garbage (it may hold NaN or inf), so it must never reach an output.

CPU speed notes, measured on a small VM (docs/benchmarks/offline.md):
- K/V are gathered a whole block at a time (``index_select`` over block ids: block_size times
  fewer indices than per token, each a contiguous copy) into buffers of a few MiB reused
  across chunks of decodes; a float32 cache is gathered straight into them, with no copy
  after. Gathering a whole 64-sequence batch at once allocates tens of MiB per call, and
  fresh pages cost more than the attention itself.
- Garbage never reaches the attention: a prefill cuts its gathered rows at its length; a
  decode chunk redirects block-table entries past a sequence's last block to a real full
  block and zeroes the few rows past the sequence's end in its last block (index_fill, at
  most block_size - 1 rows per sequence). The mask hides all of them, and finite values keep
  ``0 * v`` at zero where a garbage inf/NaN would not. A masked_fill pass over the whole
  gathered buffer cost more than the gather and the attention together.
- Decodes run SDPA with one query row per head and ``enable_gqa`` (its CPU flash kernel
  reads each KV head for its group without expanding K/V): 10-20% faster at 32-64 decodes
  than each KV head's group of query heads as its query rows.
- Everything but q, K and V is worked out once per step (`plan_attention_ref`: block ids,
  masks, tail rows, store slots, buffers) and shared by the layers; built per layer it cost
  1.0 ms of a 7.9 ms step at 1 decode and 4.0 of 41 at 64 (the model of offline.md).
- New K/V are stored with one ``index_copy_`` into the flattened cache, at the slots the
  plan picked once (padding dropped). Selecting them per layer with a boolean mask and
  writing through (block, offset) indices cost 2.9 ms per layer for 2,048 tokens against
  0.3 ms; of that, ``index_copy_`` against a (block, offset) put of the same picked slots
  is only 1.1-1.6x.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Target size of one gathered K (or V) chunk: small enough to stay in cache and to be served
# by the allocator from memory it already holds, large enough to amortize per-call overhead.
_CHUNK_BYTES = 2 << 20


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's key/value into its cache slot.

    Args:
        key, value: (T, KVH, D) the new tokens' keys and values.
        k_cache, v_cache: (num_blocks, block_size, KVH, D), written in place (any strides).
            Any float dtype; an FP8 cache (float8_e4m3fn) holds key / k_scale and
            value / v_scale, saturated to its range.
        slot_mapping: int64 (T,) slot of each token. Slots inside the null block
            (``< block_size``) and negative slots mark padding tokens and are skipped.
        plan: the step's `plan_attention_ref` (with this slot_mapping), shared by its layers.
        k_scale, v_scale: the layer's KV cache scales (1.0 unless the cache is FP8).
    """
    block_size = k_cache.shape[1]
    planned = None if plan is None else plan.store
    rows, slots = _store_index(slot_mapping, block_size) if planned is None else planned
    if rows is not None:
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    for cache, new, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        new = to_cache_dtype(new, cache.dtype, scale)
        if cache.is_contiguous():  # one row copy per token
            _bits(cache).view(-1, *cache.shape[2:]).index_copy_(0, slots, _bits(new))
        else:  # indexing by (block, offset) writes through any layout
            cache[slots // block_size, slots % block_size] = new


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` as a KV cache of `dtype` stores it: divided by the layer's scale (times its
    float32 reciprocal, which the Triton store multiplies by too: a product rounds the same
    everywhere, a GPU's float32 division need not), and for FP8 saturated to its range (a
    plain cast of a larger value is not finite on every device)."""
    if dtype == torch.float8_e4m3fn:
        return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return (x if scale == 1.0 else x.float() * (1.0 / scale)).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes, for the copies and fills torch's CPU has no FP8 kernel
    of (index_copy_, index_fill_); any other tensor as itself."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _store_index(
    slot_mapping: torch.Tensor, block_size: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows of the tokens to store, None for all; their int64 slots)."""
    keep = slot_mapping >= block_size  # (T,)
    if bool(keep.all()):
        return None, slot_mapping.long()
    rows = keep.nonzero().squeeze(1)
    return rows, slot_mapping.index_select(0, rows).long()


@dataclass
class _DecodeChunk:
    """Decodes ``lo:hi`` of a plan's longest-first order, attended together."""

    lo: int
    hi: int
    index: torch.Tensor  # (c * nb,) int64 block ids to gather, nb blocks per sequence
    tail: torch.Tensor  # gathered rows past a sequence's end in its last block (zeroed)
    mask: torch.Tensor  # (c, 1, 1, nb * block_size) bool: positions each sequence sees


@dataclass
class _Prefill:
    """A sequence attended on its own (more than one query token)."""

    rows: slice  # its query rows
    blocks: torch.Tensor  # int64 (ceil(kv_len / block_size),) its blocks
    kv_len: int
    visible: torch.Tensor  # (1, 1, q_len, kv_len) bool causal mask


@dataclass
class AttentionPlan:
    """What a step's attention works out from its metadata, once for all layers: the store's
    token rows and slots, the decodes' chunks (block ids, masks, tail rows), each prefill's
    blocks and causal mask, and gather buffers. Build it with `plan_attention_ref` from a
    cache shaped like all of the step's K and V caches; without one, each call builds its
    own (each of a model's layers would then repeat the same work)."""

    store: tuple[torch.Tensor | None, torch.Tensor] | None  # store_kv's (rows, slots); None: unplanned
    decode_rows: torch.Tensor | None  # (n,) int64 query rows of the decodes, longest first
    chunks: list[_DecodeChunk]
    prefills: list[_Prefill]
    k_bufs: _GatherBuffers | None
    v_bufs: _GatherBuffers | None


def plan_attention_ref(
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
) -> AttentionPlan:
    """The plan of a step whose every layer's cache is shaped like ``k_cache`` (arguments as
    in :func:`paged_attention_ref` and :func:`store_kv_ref`; without ``slot_mapping`` the
    plan serves the attention alone)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    store = None if slot_mapping is None else _store_index(slot_mapping, block_size)
    dev = k_cache.device
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    decodes: list[int] = []
    prefills: list[_Prefill] = []
    for i, kv_len in enumerate(kv_lens):
        q_len = starts[i + 1] - starts[i]
        if q_len > kv_len:
            raise ValueError(f"sequence {i}: {q_len} query tokens but KV length {kv_len}")
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            blocks = block_tables[i, : -(-kv_len // block_size)].long()
            q_pos = torch.arange(kv_len - q_len, kv_len, device=dev)  # (Q,)
            visible = torch.arange(kv_len, device=dev)[None, :] <= q_pos[:, None]  # (Q, L)
            prefills.append(_Prefill(slice(starts[i], starts[i + 1]), blocks, kv_len,
                                     visible[None, None]))
    if not decodes:
        return AttentionPlan(store, None, [], prefills, None, None)
    # Longest first, so a chunk's first sequence bounds its padded length; sorting also keeps
    # the padding inside each chunk small.
    decodes.sort(key=lambda i: -kv_lens[i])
    lens = [kv_lens[i] for i in decodes]
    num_blocks = [-(-n // block_size) for n in lens]
    lens_t = torch.tensor(lens, device=dev)  # (n,)
    tables = _decode_tables(block_tables, decodes, num_blocks)  # (n, nb)
    tail_seq, tail_pos = _tail_rows(lens_t, block_size)  # (m,), (m,)
    tail_ends = [0, *itertools.accumulate(-n % block_size for n in lens)]
    visible = torch.arange(num_blocks[0] * block_size, device=dev) < lens_t[:, None]  # (n, L)
    block_bytes = block_size * num_kv_heads * head_dim * 4
    chunks = []
    i = 0
    while i < len(decodes):
        nb = num_blocks[i]
        j = min(len(decodes), i + max(1, _CHUNK_BYTES // (block_bytes * nb)))
        a, b = tail_ends[i], tail_ends[j]
        tail = (tail_seq[a:b] - i) * (nb * block_size) + tail_pos[a:b]
        mask = visible[i:j, : nb * block_size][:, None, None]
        chunks.append(_DecodeChunk(i, j, tables[i:j, :nb].flatten(), tail, mask))
        i = j
    # One set of buffers for all chunks and layers: fresh multi-MiB allocations page-fault.
    max_blocks = max(_CHUNK_BYTES // block_bytes, num_blocks[0])
    rows = torch.tensor([starts[i] for i in decodes], device=dev)
    # V shares K's shape and dtype (one plan serves both caches of every layer).
    bufs = [_GatherBuffers.allocate(k_cache, max_blocks) for _ in range(2)]
    return AttentionPlan(store, rows, chunks, prefills, *bufs)


def paged_attention_ref(
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
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a packed batch of query tokens over their paged KV cache.

    Decodes (one query token) are batched together in chunks; every other sequence (chunked
    prefill with a cached prefix, or full prefill) is attended on its own. Computes in float32.

    Args:
        q: (T, H, D) query tokens of B sequences, packed back to back.
        k_cache, v_cache: (num_blocks, block_size, KVH, D); H must be a multiple of KVH and
            query head h reads KV head ``h // (H // KVH)``.
        block_tables: int32 (B, max_blocks) block ids of each sequence (unused entries 0).
        query_start_loc: int32 (B + 1,) cumulative query lengths.
        seq_lens: int32 (B,) KV length of each sequence, its new tokens included (they are
            already in the cache). Query token j of a sequence with q_len tokens sits at
            position ``seq_len - q_len + j`` and sees KV positions 0..that position.
        scale: softmax scale, usually ``D ** -0.5``.
        max_query_len: accepted for signature parity with the Triton kernel; unused.
        out: optional (T, H, D) output to fill; rows of no sequence are left untouched.
        plan: the step's `plan_attention_ref` of these arguments, shared by its layers.
        k_scale, v_scale: what the cache's keys and values are multiplied by when read (an
            FP8 cache's per-layer scales; 1.0 otherwise). The key scale folds into the
            softmax scale and the value scale into the output: one multiply each.

    Returns:
        (T, H, D) attention output in q's dtype (``out`` itself when given).
    """
    del max_query_len  # The CPU path reads the lengths directly.
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if plan is None:
        plan = plan_attention_ref(k_cache, block_tables, query_start_loc, seq_lens)
    if out is None:
        out = torch.zeros_like(q)
    scale *= k_scale
    for p in plan.prefills:
        out[p.rows] = _attend_one(q[p.rows], k_cache, v_cache, p, scale, v_scale)
    if plan.decode_rows is not None:
        _attend_decodes(q, k_cache, v_cache, plan, scale, out, v_scale)
    return out


def _attend_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: _Prefill, scale: float,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one sequence's q_len query tokens (its last ones) over kv_len positions."""
    # Whole blocks, cut at kv_len: the rest of the last block is never read.
    k = k_cache.index_select(0, p.blocks).flatten(0, 1)[: p.kv_len].float()  # (L, KVH, D)
    v = v_cache.index_select(0, p.blocks).flatten(0, 1)[: p.kv_len].float()
    o = _sdpa(q.float().transpose(0, 1)[None], k[None], v[None], p.visible, scale)
    if v_scale != 1.0:
        o = o * v_scale
    return o[0].transpose(0, 1).to(q.dtype)  # (Q, H, D)


def _attend_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    out: torch.Tensor,
    v_scale: float = 1.0,
) -> None:
    """Attention of all single-token sequences, in the plan's chunks of similar length: a
    chunk costs two block gathers, two small fills, one SDPA and one output copy."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    rows = plan.decode_rows
    assert rows is not None and plan.k_bufs is not None and plan.v_bufs is not None
    qs = q.index_select(0, rows).float()[:, :, None]  # (n, H, 1, D)
    for c in plan.chunks:
        n = c.hi - c.lo
        k = _gather_blocks(k_cache, c.index, c.tail, plan.k_bufs).view(n, -1, num_kv_heads, head_dim)
        v = _gather_blocks(v_cache, c.index, c.tail, plan.v_bufs).view(n, -1, num_kv_heads, head_dim)
        o = _sdpa(qs[c.lo:c.hi], k, v, c.mask, scale)  # (n, H, 1, D)
        if v_scale != 1.0:
            o = o * v_scale
        out.index_copy_(0, rows[c.lo:c.hi], o.reshape(n, num_heads, head_dim).to(out.dtype))


def _decode_tables(
    block_tables: torch.Tensor, decodes: list[int], num_blocks: list[int]
) -> torch.Tensor:
    """Block ids of the sequences ``decodes`` (longest first, ``num_blocks`` each): int64
    (n, num_blocks[0]). Entries past a sequence's last block (null or stale) point at the
    first block of the longest sequence, which is real and full whenever any sequence has
    more than one block, so every gathered block but the sequences' own last ones is finite."""
    order = torch.tensor(decodes, device=block_tables.device)
    tables = block_tables.index_select(0, order)[:, : num_blocks[0]].long()
    col = torch.arange(num_blocks[0], device=block_tables.device)
    past = col[None, :] >= order.new_tensor(num_blocks)[:, None]
    return torch.where(past, tables[:1, :1], tables)


def _tail_rows(lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions past each sequence's end inside its last block, the cache rows that may
    hold garbage after a block gather: (sequence, position) pairs, sequences ascending."""
    last_start = (lens - 1) // block_size * block_size  # (n,)
    offsets = torch.arange(block_size, device=lens.device)
    seq, off = (offsets[None, :] >= (lens - last_start)[:, None]).nonzero(as_tuple=True)
    return seq, last_start[seq] + off


@dataclass
class _GatherBuffers:
    """Scratch blocks reused by successive gathers: ``raw`` in the cache dtype, and ``f32``
    for the float32 copy when the cache is not float32 already."""

    raw: torch.Tensor  # (blocks, block_size, KVH, D) cache dtype
    f32: torch.Tensor | None  # (blocks * block_size, KVH, D) float32

    @classmethod
    def allocate(cls, cache: torch.Tensor, blocks: int) -> _GatherBuffers:
        raw = cache.new_empty(blocks, *cache.shape[1:])
        f32 = None if cache.dtype == torch.float32 else raw.flatten(0, 1).float()
        return cls(raw, f32)


def _gather_blocks(
    cache: torch.Tensor, index: torch.Tensor, zero_rows: torch.Tensor, bufs: _GatherBuffers
) -> torch.Tensor:
    """Blocks ``index`` of ``cache`` as float32 rows (len(index) * block_size, KVH, D), rows
    ``zero_rows`` set to 0, in the start of ``bufs`` (valid until their next use). A float32
    cache is gathered straight into the result, with no extra copy."""
    raw = torch.index_select(cache, 0, index, out=bufs.raw[: index.numel()]).flatten(0, 1)
    _bits(raw).index_fill_(0, zero_rows, 0)
    if bufs.f32 is None:
        return raw
    return bufs.f32[: raw.shape[0]].copy_(raw)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with grouped KV heads. q: (n, H, Q, D); k, v: (n, L, KVH, D); visible: bool
    broadcastable to (n, H, Q, L). Returns (n, H, Q, D). Decodes pass Q = 1 (one row per
    head), prefills their query tokens. The one place attention is computed (tests
    substitute it)."""
    return F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
