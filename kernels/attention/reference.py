"""Paged KV-cache attention in plain PyTorch: the reference for the Triton kernels and the
engine's CPU path.

Cache layout (per layer): ``k_cache``/``v_cache`` of shape (num_blocks, block_size, KVH, D).
A token's slot is ``block_id * block_size + offset``; block 0 is a reserved null block whose
content is garbage (it may hold NaN or inf), so it must never reach an output.

CPU speed notes, measured on a small VM (see the report in the PR):
- K/V are gathered per token with ``index_select`` on the flattened cache, into buffers of a
  few MiB reused across chunks of sequences. Gathering a whole 64-sequence batch at once
  allocates tens of MiB per call, and fresh pages cost more than the attention itself.
- Positions past a sequence's end are redirected to the slot of its position 0 instead of
  being zeroed afterwards: the causal mask already hides them, and real (finite) data keeps
  ``0 * v`` at zero where a garbage inf/NaN would not. A masked_fill pass over the gathered
  buffer cost more than the gather and the attention together.
"""

from __future__ import annotations

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
) -> None:
    """Write each token's key/value into its cache slot.

    Args:
        key, value: (T, KVH, D) the new tokens' keys and values.
        k_cache, v_cache: (num_blocks, block_size, KVH, D), written in place (any strides).
        slot_mapping: int64 (T,) slot of each token. Slots inside the null block
            (``< block_size``) and negative slots mark padding tokens and are skipped.
    """
    block_size = k_cache.shape[1]
    keep = slot_mapping >= block_size  # (T,)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # Indexing by (block, offset) instead of a flattened view writes through any layout.
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


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

    Returns:
        (T, H, D) attention output in q's dtype (``out`` itself when given).
    """
    del max_query_len  # The CPU path reads the lengths directly.
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    kv_lens = seq_lens.tolist()
    decodes: list[int] = []
    for i, kv_len in enumerate(kv_lens):
        q_len = starts[i + 1] - starts[i]
        if q_len > kv_len:
            raise ValueError(f"sequence {i}: {q_len} query tokens but KV length {kv_len}")
        if q_len == 1:
            decodes.append(i)
        elif q_len > 1:
            rows = slice(starts[i], starts[i + 1])
            out[rows] = _attend_one(q[rows], k_cache, v_cache, block_tables[i], kv_len, scale)
    if decodes:
        _attend_decodes(q, k_cache, v_cache, block_tables, starts, kv_lens, decodes, scale, out)
    return out


def _attend_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one sequence's q_len query tokens (its last ones) over kv_len positions."""
    q_len = q.shape[0]
    slots = _token_slots(block_table[None], [kv_len], kv_len, k_cache.shape[1])  # (1, L)
    k = _gather(k_cache, slots)  # (1, L, KVH, D)
    v = _gather(v_cache, slots)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)  # (Q,)
    visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]  # (Q, L)
    o = _sdpa(q.float().transpose(0, 1)[None], k, v, visible[None, None], scale)  # (1, H, Q, D)
    return o[0].transpose(0, 1).to(q.dtype)  # (Q, H, D)


def _attend_decodes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    kv_lens: list[int],
    decodes: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Attention of all single-token sequences, batched in chunks of similar length."""
    _, num_kv_heads, head_dim = k_cache.shape[1:]
    # Longest first, so a chunk's first sequence bounds its padded length; sorting also keeps
    # the padding inside each chunk small.
    decodes = sorted(decodes, key=lambda i: -kv_lens[i])
    bytes_per_pos = num_kv_heads * head_dim * 4
    # One set of buffers for all chunks: fresh multi-MiB allocations per chunk page-fault.
    max_rows = max(_CHUNK_BYTES // bytes_per_pos, kv_lens[decodes[0]])
    k_bufs = _GatherBuffers.allocate(k_cache, max_rows)
    v_bufs = _GatherBuffers.allocate(v_cache, max_rows)
    i = 0
    while i < len(decodes):
        chunk = max(1, _CHUNK_BYTES // (bytes_per_pos * max(1, kv_lens[decodes[i]])))
        ids = decodes[i : i + chunk]
        i += len(ids)
        lens = [kv_lens[j] for j in ids]
        num_pos = lens[0]
        idx = torch.tensor(ids, device=block_tables.device)
        slots = _token_slots(block_tables[idx], lens, num_pos, k_cache.shape[1])  # (n, L)
        k = _gather(k_cache, slots, k_bufs)  # (n, L, KVH, D)
        v = _gather(v_cache, slots, v_bufs)
        rows = torch.tensor([starts[j] for j in ids], device=q.device)
        visible = slots.new_tensor(lens)[:, None] > torch.arange(num_pos, device=q.device)  # (n, L)
        qc = q[rows].float()[:, :, None]  # (n, H, 1, D)
        o = _sdpa(qc, k, v, visible[:, None, None], scale)  # (n, H, 1, D)
        out[rows] = o[:, :, 0].to(out.dtype)


def _token_slots(
    block_tables: torch.Tensor, kv_lens: list[int], num_pos: int, block_size: int
) -> torch.Tensor:
    """Cache slot of positions 0..num_pos-1 of each sequence: (n, num_pos) int64.

    Positions at or past a sequence's length point at its position 0, so the gathered values
    there are finite; the attention mask hides them.
    """
    pos = torch.arange(num_pos, device=block_tables.device)  # (L,)
    blocks = block_tables[:, : -(-num_pos // block_size)].long()  # (n, nb)
    slots = blocks[:, pos // block_size] * block_size + pos % block_size  # (n, L)
    inside = pos[None, :] < pos.new_tensor(kv_lens)[:, None]  # (n, L)
    return torch.where(inside, slots, slots[:, :1])


@dataclass
class _GatherBuffers:
    """Scratch rows reused by successive gathers: ``raw`` in the cache dtype, and ``f32`` for
    the float32 copy when the cache is not float32 already."""

    raw: torch.Tensor  # (rows, KVH, D) cache dtype
    f32: torch.Tensor | None  # (rows, KVH, D) float32

    @classmethod
    def allocate(cls, cache: torch.Tensor, rows: int) -> _GatherBuffers:
        raw = cache.new_empty(rows, *cache.shape[2:])
        f32 = None if cache.dtype == torch.float32 else raw.float()
        return cls(raw, f32)


def _gather(
    cache: torch.Tensor, slots: torch.Tensor, bufs: _GatherBuffers | None = None
) -> torch.Tensor:
    """Rows of ``cache`` at ``slots`` (n, L) as float32 (n, L, KVH, D), written into the
    start of ``bufs`` when given (the result is then only valid until their next use)."""
    flat = cache.reshape(-1, *cache.shape[2:])  # (num_blocks * block_size, KVH, D)
    index = slots.flatten()
    if bufs is None:
        rows = torch.index_select(flat, 0, index).float()
    else:
        rows = torch.index_select(flat, 0, index, out=bufs.raw[: index.numel()])
        if bufs.f32 is not None:
            rows = bufs.f32[: index.numel()].copy_(rows)
    return rows.view(*slots.shape, *cache.shape[2:])


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA with grouped KV heads. q: (n, H, Q, D); k, v: (n, L, KVH, D); visible: bool
    broadcastable to (n, H, Q, L). Returns (n, H, Q, D)."""
    return F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, scale=scale,
        enable_gqa=q.shape[1] != k.shape[2],
    )
