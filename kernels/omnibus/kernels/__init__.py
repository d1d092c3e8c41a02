"""Compute kernels: paged KV-cache attention, batched multi-LoRA, the fused elementwise
ops of a decoder layer (RMSNorm with residual add, rotary embedding, SwiGLU), and the W4A16
matmul (4-bit weights, 16/32-bit activations).

Each op has a torch reference (``*_ref``, also the CPU path) and a Triton version
(``*_triton``). The dispatchers below (``store_kv``, ``paged_attention``, ``lora_shrink``,
``lora_expand``, ``rms_norm``, ``add_rms_norm``, ``rope``, ``silu_and_mul``, ``int4_matmul``)
pick Triton for CUDA tensors and the reference otherwise;
``OMNIBUS_FORCE_TRITON=1`` forces Triton on CPU, for testing under ``TRITON_INTERPRET=1``.

Triton is only imported when a Triton kernel is first used, so this package imports on hosts
without it.
"""

from __future__ import annotations

import os

import torch

from omnibus.kernels.attention.reference import (
    AttentionPlan,
    paged_attention_ref,
    plan_attention_ref,
    store_kv_ref,
)
from omnibus.kernels.fused.reference import rope_ref, silu_and_mul_ref
from omnibus.kernels.lora.reference import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton
from omnibus.kernels.norm.reference import add_rms_norm_ref, rms_norm_ref
from omnibus.kernels.quant.reference import int4_matmul_ref

__all__ = [
    "store_kv_ref",
    "paged_attention_ref",
    "lora_shrink_ref",
    "lora_expand_ref",
    "lora_shrink_triton",
    "lora_expand_triton",
    "store_kv",
    "paged_attention",
    "plan_attention",
    "AttentionPlan",
    "lora_shrink",
    "lora_expand",
    "use_triton",
    "rms_norm_ref",
    "add_rms_norm_ref",
    "rope_ref",
    "silu_and_mul_ref",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "silu_and_mul",
    "int4_matmul_ref",
    "int4_matmul",
]


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` run the Triton kernels: on CUDA, or when forced by the env var
    (read at every call, so tests can set it with monkeypatch)."""
    return t.is_cuda or os.environ.get("OMNIBUS_FORCE_TRITON") == "1"


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes new keys/values into their cache slots; see :func:`store_kv_ref` (``plan``:
    the step's :func:`plan_attention`; the Triton kernel does without)."""
    if use_triton(key):
        from omnibus.kernels.attention.triton_kernels import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, plan, k_scale, v_scale)


def plan_attention(
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> AttentionPlan | None:
    """The step's attention work that every layer shares, worked out once (the CPU path,
    :func:`plan_attention_ref`); None where the Triton kernels run (they need none)."""
    if use_triton(k_cache):
        return None
    return plan_attention_ref(k_cache, block_tables, query_start_loc, seq_lens, slot_mapping)


def paged_attention(
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
    """Causal attention of a packed mixed batch over the paged cache; see
    :func:`paged_attention_ref`. Returns (T, H, D) in q's dtype. ``plan``: the step's
    :func:`plan_attention` (the reference's; the Triton kernels ignore it)."""
    if use_triton(q):
        from omnibus.kernels.attention.triton_kernels import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
            out=out, k_scale=k_scale, v_scale=v_scale,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
        out=out, plan=plan, k_scale=k_scale, v_scale=v_scale,
    )


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    max_seg_len: int | None = None,
) -> torch.Tensor:
    """Per-segment ``x @ A[slot].T`` as (T, max_rank) float32; see :func:`lora_shrink_ref`.
    ``max_seg_len``, the longest segment (known on the host), sizes the Triton grid; without
    it the grid covers T tokens per segment."""
    if use_triton(x):
        return lora_shrink_triton(x, lora_a, seg_starts, seg_slots, max_seg_len=max_seg_len)
    return lora_shrink_ref(x, lora_a, seg_starts, seg_slots)


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    max_seg_len: int | None = None,
) -> None:
    """In place ``out += scale * y @ B[slot].T`` per segment; see :func:`lora_expand_ref`
    (``max_seg_len`` as in :func:`lora_shrink`)."""
    if use_triton(y):
        lora_expand_triton(y, lora_b, seg_starts, seg_slots, scales, out, max_seg_len=max_seg_len)
    else:
        lora_expand_ref(y, lora_b, seg_starts, seg_slots, scales, out)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of (T, H) rows as a new tensor; see :func:`rms_norm_ref`."""
    if use_triton(x):
        from omnibus.kernels.norm.triton_kernels import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` IN PLACE (in its dtype), then returns ``(rms_norm(residual),
    residual)``; see :func:`add_rms_norm_ref`. x, residual: (T, H)."""
    if use_triton(x):
        from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D) and k (T, KVH, D) rotated by each token's position; see :func:`rope_ref`.
    The Triton path rotates in place (q and k may be strided views of a fused qkv output)
    and returns them; the reference returns new tensors. Use the returned pair."""
    if use_triton(q):
        from omnibus.kernels.fused.triton_kernels import rope_triton

        return rope_triton(q, k, cos_table, sin_table, positions)
    return rope_ref(q, k, cos_table, sin_table, positions)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) -> (T, I) ``silu(gate) * up`` as a new tensor; see :func:`silu_and_mul_ref`."""
    if use_triton(gate_up):
        from omnibus.kernels.fused.triton_kernels import silu_and_mul_triton

        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """(T, in) x times a 4-bit (out, in) weight, transposed: (T, out) in x's dtype; see
    :func:`int4_matmul_ref` (w = (q - 8) * scale + zero, per group of input columns)."""
    if use_triton(x):
        from omnibus.kernels.quant.triton_kernels import int4_matmul_triton

        return int4_matmul_triton(x, packed, scales, zeros, group)
    return int4_matmul_ref(x, packed, scales, zeros, group)
