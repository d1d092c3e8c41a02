"""Fused elementwise kernels (RMSNorm with residual add, rotary embedding, SwiGLU): the torch
references against the engine's model code bit for bit, and the Triton kernels (run by the
interpreter on CPU) against the references.

Triton outputs are pre-filled with NaN wherever the kernel writes a separate output, so an
element it skips shows up; in-place kernels are checked to leave everything around their
views untouched.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from omnibus import kernels
from omnibus.engine.config import RopeScaling
from omnibus.engine.model.llama import RotaryEmbedding
from omnibus.kernels.fused.reference import rope_ref, silu_and_mul_ref
from omnibus.kernels.norm.reference import add_rms_norm_ref, rms_norm_ref

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
MAX_LEN = 64
# Hidden sizes: below, at and above a power of two.
HIDDEN = [37, 64, 100]
# (tokens, query heads, KV heads, head dim): GQA ratios 1, 4 and 8; head dims whose half is
# not a power of two (12, 20).
ROPE_LAYOUTS = [(1, 2, 2, 16), (7, 8, 2, 12), (5, 8, 1, 20), (13, 4, 1, 16)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def rope_tables(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's own float32 (MAX_LEN, D) cos/sin tables."""
    cfg = SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=RopeScaling())
    rot = RotaryEmbedding(cfg, MAX_LEN)  # type: ignore[arg-type]
    return rot.cos, rot.sin


def shuffled_positions(gen: torch.Generator, num_tokens: int) -> torch.Tensor:
    """int64 (T,) distinct positions in random order, away from 0 (where rope is identity)."""
    return torch.randperm(MAX_LEN - 1, generator=gen)[:num_tokens] + 1


def fused_qkv(
    gen: torch.Generator, num_tokens: int, heads: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k): q (T, H, D) and k (T, KVH, D) as strided views of one (T, q+2kv+3)
    buffer, like the split of a fused projection output (3 spare columns make the row
    stride unlike anything contiguous)."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = randn(gen, num_tokens, q_size + 2 * kv_size + 3, dtype=dtype)
    q = qkv[:, :q_size].view(num_tokens, heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
    return qkv, q, k


# ---------------------------------------------------------------------------------------------
# The references (the engine's CPU path) are transformers' math, bit for bit.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_refs_equal_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(100, EPS).to(dtype)
    norm.weight.data = randn(gen, 100, dtype=dtype)
    x, residual = randn(gen, 9, 100, dtype=dtype), randn(gen, 9, 100, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(rms_norm_ref(x, norm.weight, EPS), norm(x))
        summed = residual + x  # the decoder layer's `hidden_states = residual + hidden_states`
        out, new_residual = add_rms_norm_ref(x, residual.clone(), norm.weight, EPS)
        assert torch.equal(new_residual, summed)
        assert torch.equal(out, norm(summed))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_ref_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(1)
    cfg = SimpleNamespace(head_dim=16, rope_theta=500000.0,
                          rope_scaling=RopeScaling("llama3", factor=8.0,
                                                   original_max_position_embeddings=32))
    rot = RotaryEmbedding(cfg, MAX_LEN)  # type: ignore[arg-type]
    _, q, k = fused_qkv(gen, 7, 8, 2, 16, dtype)
    positions = shuffled_positions(gen, 7)
    q_ref, k_ref = rope_ref(q, k, rot.cos, rot.sin, positions)
    # transformers casts the (T, D) rows to the activation dtype, then rotates.
    q_hf, k_hf = apply_rotary_pos_emb(q, k, rot.cos[positions].to(dtype), rot.sin[positions].to(dtype),
                                      unsqueeze_dim=1)
    assert q_ref.dtype == dtype
    assert torch.equal(q_ref, q_hf) and torch.equal(k_ref, k_hf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_ref_equals_transformers(dtype: torch.dtype) -> None:
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(2)
    gate, up = randn(gen, 5, 48, dtype=dtype), randn(gen, 5, 48, dtype=dtype)
    # Within rounding, not bit for bit: torch's CPU silu takes another (vectorized) path on
    # contiguous input than on the strided half of a fused gate/up output.
    torch.testing.assert_close(silu_and_mul_ref(torch.cat([gate, up], dim=-1)), ACT2FN["silu"](gate) * up)


# ---------------------------------------------------------------------------------------------
# Triton against the references (float32 unless said otherwise).
# ---------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_rms_norm_triton(num_tokens: int, hidden: int) -> None:
    from omnibus.kernels.norm.triton_kernels import rms_norm_triton

    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x, weight = randn(gen, num_tokens, hidden), randn(gen, hidden)
    out = torch.full_like(x, float("nan"))
    assert rms_norm_triton(x, weight, EPS, out=out) is out
    assert rel_err(out, rms_norm_ref(x, weight, EPS)) < 1e-5


@needs_triton
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_add_rms_norm_triton(num_tokens: int, hidden: int) -> None:
    """The residual is updated in place; x and the rows' neighbours are left alone."""
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton

    gen = torch.Generator().manual_seed(10 + hidden + num_tokens)
    x, weight = randn(gen, num_tokens, hidden), randn(gen, hidden)
    # The residual as a column slice of a wider buffer: strided rows, untouched margins.
    buf = randn(gen, num_tokens, hidden + 5)
    residual = buf[:, 2 : 2 + hidden]
    x_before, buf_before = x.clone(), buf.clone()
    ref_out, ref_res = add_rms_norm_ref(x, residual.clone(), weight, EPS)

    out = torch.full_like(x, float("nan"))
    got_out, got_res = add_rms_norm_triton(x, residual, weight, EPS, out=out)
    assert got_out is out and got_res is residual
    assert torch.equal(residual, ref_res)  # a float32 add: exact
    assert rel_err(out, ref_out) < 1e-5
    assert torch.equal(x, x_before)
    margins = [slice(0, 2), slice(2 + hidden, None)]
    assert all(torch.equal(buf[:, m], buf_before[:, m]) for m in margins)


@needs_triton
def test_norm_triton_out_aliases_x() -> None:
    """``out=x`` is allowed: each row is read whole before it is written."""
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton, rms_norm_triton

    gen = torch.Generator().manual_seed(3)
    x, residual, weight = randn(gen, 4, 100), randn(gen, 4, 100), randn(gen, 100)
    ref_out, ref_res = add_rms_norm_ref(x, residual.clone(), weight, EPS)
    add_rms_norm_triton(x, residual, weight, EPS, out=x)
    assert rel_err(x, ref_out) < 1e-5 and torch.equal(residual, ref_res)
    ref = rms_norm_ref(residual, weight, EPS)
    assert rel_err(rms_norm_triton(residual, weight, EPS, out=residual), ref) < 1e-5


@needs_triton
def test_norm_triton_fp16_rounds_like_reference() -> None:
    """In fp16 the residual sum is bit-exact and the output within an fp16 rounding step
    (only the fp32 reduction order differs)."""
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton

    gen = torch.Generator().manual_seed(4)
    x, residual = randn(gen, 6, 100, dtype=torch.float16), randn(gen, 6, 100, dtype=torch.float16)
    weight = randn(gen, 100, dtype=torch.float16)
    ref_out, ref_res = add_rms_norm_ref(x, residual.clone(), weight, EPS)
    out, res = add_rms_norm_triton(x, residual, weight, EPS)
    assert out.dtype == torch.float16
    assert torch.equal(res, ref_res)
    torch.testing.assert_close(out, ref_out, rtol=1e-3, atol=1e-3)


@needs_triton
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", ROPE_LAYOUTS)
def test_rope_triton(num_tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """In place on q/k views of a fused qkv buffer; v and the spare columns untouched."""
    from omnibus.kernels.fused.triton_kernels import rope_triton

    gen = torch.Generator().manual_seed(num_tokens * heads + head_dim)
    qkv, q, k = fused_qkv(gen, num_tokens, heads, kv_heads, head_dim)
    cos, sin = rope_tables(head_dim)
    positions = shuffled_positions(gen, num_tokens)
    q_ref, k_ref = rope_ref(q, k, cos, sin, positions)
    before = qkv.clone()

    got_q, got_k = rope_triton(q, k, cos, sin, positions)
    assert got_q is q and got_k is k
    assert rel_err(q, q_ref) < 1e-5 and rel_err(k, k_ref) < 1e-5
    qk_end = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, qk_end:], before[:, qk_end:])


@needs_triton
def test_rope_triton_reads_both_table_halves() -> None:
    """Tables that are not half-duplicated (every entry distinct) and transposed in memory
    still give the reference's result, and repeated positions are fine."""
    from omnibus.kernels.fused.triton_kernels import rope_triton

    gen = torch.Generator().manual_seed(5)
    _, q, k = fused_qkv(gen, 6, 4, 1, 12)
    cos = randn(gen, 12, MAX_LEN).T  # (MAX_LEN, D), column-major
    sin = randn(gen, 12, MAX_LEN).T
    positions = torch.tensor([5, 5, 63, 0, 17, 2])
    q_ref, k_ref = rope_ref(q, k, cos, sin, positions)
    rope_triton(q, k, cos, sin, positions)
    assert rel_err(q, q_ref) < 1e-5 and rel_err(k, k_ref) < 1e-5


@needs_triton
def test_rope_triton_fp16_bit_exact() -> None:
    """Every product and sum is rounded where the reference rounds: equal bits in fp16."""
    from omnibus.kernels.fused.triton_kernels import rope_triton

    gen = torch.Generator().manual_seed(6)
    _, q, k = fused_qkv(gen, 9, 8, 2, 16, torch.float16)
    cos, sin = rope_tables(16)
    positions = shuffled_positions(gen, 9)
    q_ref, k_ref = rope_ref(q, k, cos, sin, positions)
    rope_triton(q, k, cos, sin, positions)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@needs_triton
@pytest.mark.parametrize("inter", [1, 37, 64, 1100])  # 1100: two column tiles, the last partial
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_silu_and_mul_triton(num_tokens: int, inter: int) -> None:
    from omnibus.kernels.fused.triton_kernels import silu_and_mul_triton

    gen = torch.Generator().manual_seed(inter + num_tokens)
    gate_up = randn(gen, num_tokens, 2 * inter + 4)[:, 1 : 1 + 2 * inter]  # strided rows
    out = torch.full((num_tokens, inter), float("nan"))
    assert silu_and_mul_triton(gate_up, out=out) is out
    assert rel_err(out, silu_and_mul_ref(gate_up)) < 1e-5


@needs_triton
def test_triton_empty_batch() -> None:
    """No tokens (e.g. an idle step): nothing is launched, shapes still come out right."""
    from omnibus.kernels.fused.triton_kernels import rope_triton, silu_and_mul_triton
    from omnibus.kernels.norm.triton_kernels import add_rms_norm_triton, rms_norm_triton

    x, weight = torch.empty(0, 8), torch.ones(8)
    assert rms_norm_triton(x, weight, EPS).shape == (0, 8)
    assert add_rms_norm_triton(x, x.clone(), weight, EPS)[0].shape == (0, 8)
    assert silu_and_mul_triton(torch.empty(0, 8)).shape == (0, 4)
    cos, sin = rope_tables(8)
    rope_triton(torch.empty(0, 2, 8), torch.empty(0, 1, 8), cos, sin, torch.empty(0).long())


# ---------------------------------------------------------------------------------------------
# Dispatchers
# ---------------------------------------------------------------------------------------------


def _call_all(gen_seed: int) -> list[torch.Tensor]:
    """Runs every dispatcher on the same inputs; returns all outputs (in-place ones too)."""
    gen = torch.Generator().manual_seed(gen_seed)
    x, residual, weight = randn(gen, 5, 37), randn(gen, 5, 37), randn(gen, 37)
    _, q, k = fused_qkv(gen, 5, 4, 1, 12)
    cos, sin = rope_tables(12)
    positions = shuffled_positions(gen, 5)
    gate_up = randn(gen, 5, 2 * 37)
    normed = kernels.rms_norm(x, weight, EPS)
    out, new_residual = kernels.add_rms_norm(x, residual, weight, EPS)
    assert new_residual is residual
    q_rot, k_rot = kernels.rope(q, k, cos, sin, positions)  # in place on the Triton path only
    return [normed, out, residual, q_rot, k_rot, kernels.silu_and_mul(gate_up)]


@needs_triton
def test_dispatch_forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU path and OMNIBUS_FORCE_TRITON=1 (every Triton launcher called once) agree."""
    from omnibus.kernels.fused import triton_kernels as fused_triton
    from omnibus.kernels.norm import triton_kernels as norm_triton

    calls: list[str] = []

    def spy(module: Any, name: str) -> None:
        real = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    for module, name in [(norm_triton, "rms_norm_triton"), (norm_triton, "add_rms_norm_triton"),
                         (fused_triton, "rope_triton"), (fused_triton, "silu_and_mul_triton")]:
        spy(module, name)
    monkeypatch.delenv("OMNIBUS_FORCE_TRITON", raising=False)
    expect = _call_all(7)
    assert calls == []
    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    got = _call_all(7)
    assert sorted(calls) == sorted(
        ["rms_norm_triton", "add_rms_norm_triton", "rope_triton", "silu_and_mul_triton"]
    )
    for g, e in zip(got, expect):
        assert rel_err(g, e) < 1e-5


def test_dispatch_cpu_path_is_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton forced, CPU tensors get the references' exact bits."""
    monkeypatch.delenv("OMNIBUS_FORCE_TRITON", raising=False)
    gen = torch.Generator().manual_seed(8)
    _, q, k = fused_qkv(gen, 4, 4, 2, 16, torch.bfloat16)
    cos, sin = rope_tables(16)
    positions = shuffled_positions(gen, 4)
    q_ref, k_ref = rope_ref(q, k, cos, sin, positions)
    q_rot, k_rot = kernels.rope(q, k, cos, sin, positions)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    gate_up = randn(gen, 3, 20, dtype=torch.bfloat16)
    gate, up = gate_up.split(10, dim=-1)
    assert torch.equal(kernels.silu_and_mul(gate_up), F.silu(gate) * up)
