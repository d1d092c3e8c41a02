"""float32 `tl.dot` must stay float32 on NVIDIA GPUs (issue #17, defect 1).

Triton's NVIDIA backend feeds float32 dot operands to TF32 tensor cores by default (10
mantissa bits); the interpreter computes plain float32, so the CPU suite cannot see it.
Here the CPU shows why it matters (10-bit operands flip a greedy token of a float32 engine)
and checks what compiled Triton emits for sm_90: no TF32 instruction for float32 inputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import omnibus.kernels.attention.reference as attention_ref
from omnibus.common.sampling import SamplingParams
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import Engine
from omnibus.kernels.attention import triton_kernels as attention_triton
from omnibus.kernels.lora import triton_kernels as lora_triton
from tests.checkpoints import make_checkpoint
from tests.kernels.launches import record_launches, sm90_ptx
from tests.kernels.test_kernels_attention import make_batch, mixed_specs
from tests.kernels.test_kernels_lora import make_lora_batch


def tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32's 10 mantissa bits (to nearest, ties away: cvt.rna.tf32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def sdpa_tf32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
              scale: float) -> torch.Tensor:
    """The reference's SDPA (q (n, H, Q, D), k/v (n, L, KVH, D)) with the kernel's two dots on
    TF32 operands: q, k, the unnormalized probabilities p, and v."""
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # (n, KVH, L, D)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (tf32(q) @ tf32(k).transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    p = (s - s.amax(-1, keepdim=True)).exp()  # (n, H, Q, L)
    return (tf32(p) @ tf32(v)) / p.sum(-1, keepdim=True)


def test_tf32_attention_operands_flip_a_greedy_token(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompts of tests/gpu/test_engine_gpu.py, float32 engine on the CPU: TF32 operands in
    attention alone change prompt 2's greedy output from its 17th token on. (Hardware mma
    on raw float32 registers drops the 13 low bits instead of rounding; on these prompts that
    happens not to flip a token, but it is the same 10-bit precision.)"""
    path = make_checkpoint(tmp_path / "m", "llama")
    prompts = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((1, 9, 16, 17, 40, 130, 300))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (12, 5, 20, 8, 16, 10, 6)]

    def generate() -> list[list[int]]:
        engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=64 << 20,
                                     max_num_batched_tokens=64))
        return engine.generate(prompts, params)

    exact = generate()
    monkeypatch.setattr(attention_ref, "_sdpa", sdpa_tf32)
    rounded = generate()
    assert [i for i in range(len(prompts)) if rounded[i] != exact[i]] == [2]
    assert rounded[2][:16] == exact[2][:16] and rounded[2][16] != exact[2][16]


def _launch_dot_kernels(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> list:
    """One interpreted launch of each dot kernel with `dtype` inputs, recorded."""
    recorded = {name: record_launches(monkeypatch, attention_triton, name)
                for name in ("_extend_kernel", "_decode_kernel")}
    recorded |= {name: record_launches(monkeypatch, lora_triton, name)
                 for name in ("_shrink_kernel", "_expand_kernel")}
    b = make_batch(mixed_specs(8), 4, 16, 8, seed=0, dtype=dtype)
    attention_triton.paged_attention_triton(b.q, b.k_cache, b.v_cache, b.block_tables,
                                            b.query_start_loc, b.seq_lens, b.scale, b.max_query_len)
    lb = make_lora_batch([4, 16, 8], 16, seed=0)
    x, lora_a, lora_b = lb.x.to(dtype), lb.lora_a.to(dtype), lb.lora_b.to(dtype)
    y = lora_triton.shrink(x, lora_a, lb.seg_starts, lb.seg_slots, None, None)
    lora_triton.expand(y, lora_b, lb.seg_starts, lb.seg_slots, lb.scales, torch.zeros(x.shape[0], 80, dtype=dtype),
                       None)
    return [(module.__name__, name, recorded[name][0])
            for module, names in ((attention_triton, ("_extend_kernel", "_decode_kernel")),
                                  (lora_triton, ("_shrink_kernel", "_expand_kernel")))
            for name in names]


def test_float32_dots_compile_to_ieee_float32_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 launches ask for "ieee", which compiles to FMA instead of TF32 mma (before:
    mma.sync/wgmma ....tf32 in all four kernels)."""
    launches = _launch_dot_kernels(monkeypatch, torch.float32)
    assert [launch.kwargs["DOT_PRECISION"] for _, _, launch in launches] == ["ieee"] * 4
    ptx = sm90_ptx(launches)
    assert [("tf32" in p, "fma.rn.f32" in p) for p in ptx] == [(False, True)] * 4
