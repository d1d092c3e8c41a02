"""W4A16 matmul: packing, the torch reference against a float64 dequantize-then-matmul, and
the Triton kernel (interpreter on CPU) against the reference in float32, bfloat16 and
float16, plus its split-K path, its refusals and a compile for sm_90."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omnibus.kernels.quant.reference import int4_matmul_ref, pack_int4, unpack_int4

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
IN_DIM = 256  # 8 groups of 32, 2 of 128


def make_weight(out_dim: int, in_dim: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(q, packed, scales, zeros): uniform codes, positive scales of a real checkpoint's
    size (~1/8 of a unit weight per step) and zeros of either sign."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_dim, in_dim), generator=gen, dtype=torch.uint8)
    scales = 0.02 + 0.1 * torch.rand(out_dim, in_dim // group, generator=gen)
    zeros = 0.05 * torch.randn(out_dim, in_dim // group, generator=gen)
    return q, pack_int4(q), scales, zeros


def dense_f64(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group: int) -> torch.Tensor:
    """The definition, element by element from the unpacked codes, in float64."""
    s = scales.double().repeat_interleave(group, dim=1)
    z = zeros.double().repeat_interleave(group, dim=1)
    w = (q.double() - 8) * s + z  # (out, in)
    return x.double() @ w.T


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise error, relative to the largest magnitude of the reference."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def test_pack_unpack_round_trip() -> None:
    q = torch.randint(0, 16, (5, 12), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # the layout itself: even column in the low nibble, odd column in the high one
    assert pack_int4(torch.tensor([[3, 10, 15, 0]], dtype=torch.uint8)).tolist() == [[0xA3, 0x0F]]
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)


def test_pack_refuses_what_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"in even, got shape \(2, 3\)"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15, got a maximum of 16"):
        pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_matches_float64_dequantize_then_matmul(group: int) -> None:
    """The reference computes in float32: over 256 products its error against float64 is
    a few float32 ulps of the output (~1e-7), so 1e-5 of the largest output catches any
    mistake in the layout or the formula (those are O(1)) without flaking."""
    q, packed, scales, zeros = make_weight(100, IN_DIM, group, seed=group)
    x = torch.randn(17, IN_DIM, generator=torch.Generator().manual_seed(1))
    y = int4_matmul_ref(x, packed, scales, zeros, group)
    assert y.dtype == torch.float32 and y.shape == (17, 100)
    assert max_err(y, dense_f64(x, q, scales, zeros, group)) < 1e-5
    # bf16 x: the product in float32, rounded once to bf16 (half an ulp, <= 2**-8 relative)
    x16 = x.bfloat16()
    y16 = int4_matmul_ref(x16, packed, scales, zeros, group)
    assert y16.dtype == torch.bfloat16
    assert max_err(y16, dense_f64(x16, q, scales, zeros, group)) <= 2.0**-8


# ---------------------------------------------------------------------------------------------
# Triton (interpreted)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_bf16(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bfloat16 in the Triton interpreter as on the GPU. triton 3.9's interpreter holds
    bf16 as its uint16 bit patterns and (1) its tl.dot multiplies those raw bits as
    integers, (2) its float32 -> bf16 cast truncates where the GPU's cvt.rn.bf16.f32 rounds
    to nearest even. Both are patched here; the kernel code is what runs on the GPU."""
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def as_f32(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def dot(self: object, a: interpreter.TensorHandle, b: interpreter.TensorHandle, *rest: object) -> object:
        return create_dot(self, as_f32(a), as_f32(b), *rest)

    def cast(self: object, src: interpreter.TensorHandle, dst_type: tl.dtype) -> object:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", dot)
    monkeypatch.setattr(builder, "cast_impl", cast)
    yield


# Largest error allowed, relative to the largest output magnitude. float32: the kernel and
# the reference differ only in summation order (~1e-7 seen), so 1e-4 is tight. 16-bit: the
# kernel rounds each dequantized weight to x's dtype for the tensor-core dot (half an ulp,
# 2**-9 for bf16 and 2**-12 for fp16, relative; random over 256 products) and both round the
# output once: seen up to 0.75 ulp of the output's dtype at the largest output. 2 ulps
# (2 * eps of the dtype: 1.6% for bf16, 0.2% for fp16) leaves room without letting a wrong
# nibble, scale or group (errors of the output's own size) through; the float32 cases,
# through the same code, check the arithmetic itself to 1e-4.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2 * 2.0**-7, torch.float16: 2 * 2.0**-10}

# (T, out, group): T 1 (decode, one row of a 16-row tile), 3, 17 (two row tiles, the second
# nearly empty), 64 (one full tile); out 48 and 100 (not multiples of the 64-column tile).
SHAPES = [(1, 48, 32), (3, 100, 64), (17, 48, 128), (64, 100, 32), (1, 100, 128), (17, 100, 64)]


def triton_matmul(*args: object, **kwargs: object) -> torch.Tensor:
    from omnibus.kernels.quant.triton_kernels import int4_matmul_triton

    return int4_matmul_triton(*args, **kwargs)  # type: ignore[arg-type]


@needs_triton
@pytest.mark.usefixtures("gpu_bf16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens,out_dim,group", SHAPES)
def test_triton_matches_reference(tokens: int, out_dim: int, group: int, dtype: torch.dtype) -> None:
    _, packed, scales, zeros = make_weight(out_dim, IN_DIM, group, seed=tokens + out_dim + group)
    x = torch.randn(tokens, IN_DIM, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    y = triton_matmul(x, packed, scales, zeros, group)
    assert y.dtype == dtype and y.shape == (tokens, out_dim)
    assert max_err(y, int4_matmul_ref(x, packed, scales, zeros, group)) < TOLERANCE[dtype]


@needs_triton
@pytest.mark.usefixtures("gpu_bf16")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split_k", [2, 3, 100])
def test_triton_split_k(split_k: int, dtype: torch.dtype) -> None:
    """Reduction split over programs (8 steps of 32 columns: 2 splits of 4 steps, 3 of 3
    steps with a short last one, 100 capped at 8 of one step): the same result."""
    _, packed, scales, zeros = make_weight(100, IN_DIM, 32, seed=split_k)
    x = torch.randn(3, IN_DIM, generator=torch.Generator().manual_seed(split_k)).to(dtype)
    y = triton_matmul(x, packed, scales, zeros, 32, split_k=split_k)
    assert max_err(y, int4_matmul_ref(x, packed, scales, zeros, 32)) < TOLERANCE[dtype]


@needs_triton
def test_triton_strided_operands_and_larger_groups() -> None:
    """x a column slice of a wider activation, packed/scales/zeros row slices of a stacked
    weight; group 256 (steps of 128 inside one group) and 48 (steps of 16)."""
    for group in (256, 48):
        in_dim = 2 * group if group == 256 else 3 * group
        _, packed, scales, zeros = make_weight(60, in_dim, group, seed=group)
        wide = torch.randn(5, in_dim + 16, generator=torch.Generator().manual_seed(group))
        x = wide[:, 8 : 8 + in_dim]
        y = triton_matmul(x, packed[10:], scales[10:], zeros[10:], group)
        assert max_err(y, int4_matmul_ref(x, packed[10:], scales[10:], zeros[10:], group)) < 1e-4


def test_split_k_heuristic() -> None:
    """Splits only when the output tiles leave SMs idle: ~2 programs per SM, >= 4 steps each."""
    from omnibus.kernels.quant.triton_kernels import block_k_for, split_k_for

    assert [block_k_for(g) for g in (32, 64, 128, 256, 48)] == [32, 64, 128, 128, 16]
    assert split_k_for(output_tiles=64, k_steps=32, num_sms=132) == 5  # 4096 x 4096 decode
    assert split_k_for(output_tiles=224, k_steps=32, num_sms=132) == 1  # 14336 x 4096
    assert split_k_for(output_tiles=64, k_steps=8, num_sms=132) == 2  # short K: 4 steps each
    assert split_k_for(output_tiles=1, k_steps=2, num_sms=132) == 1


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=needs_triton)])
def test_bad_inputs_name_the_shapes(impl: str) -> None:
    matmul = int4_matmul_ref if impl == "ref" else triton_matmul
    _, packed, scales, zeros = make_weight(48, IN_DIM, 32, seed=0)
    x = torch.randn(2, IN_DIM)
    with pytest.raises(ValueError, match=r"in \(250, from x \(2, 250\)\) must be a multiple of group \(32\)"):
        matmul(torch.randn(2, 250), packed, scales, zeros, 32)
    with pytest.raises(ValueError, match=r"packed \(48, 64\) must be \(out, in // 2\) = \(48, 128\) for x \(2, 256\)"):
        matmul(x, packed[:, :64], scales, zeros, 32)
    with pytest.raises(ValueError, match=r"scales must be float32 \(out, in // group\) = \(48, 4\) .* got \(48, 8\)"):
        matmul(x, packed, scales, zeros, 64)
    with pytest.raises(ValueError, match=r"zeros must be .* = \(48, 8\) .* got \(47, 8\)"):
        matmul(x, packed, scales, zeros[1:], 32)
    with pytest.raises(ValueError, match="packed must be uint8"):
        matmul(x, packed.to(torch.int8), scales, zeros, 32)
    with pytest.raises(ValueError, match=r"x must be \(T, in\) and packed \(out, in // 2\), got x \(256,\)"):
        matmul(x[0], packed, scales, zeros, 32)


@needs_triton
def test_triton_refusals_and_empty_shapes() -> None:
    _, packed, scales, zeros = make_weight(48, 48, 24, seed=0)
    with pytest.raises(ValueError, match="group must be a multiple of 16, got 24"):
        triton_matmul(torch.randn(1, 48), packed, scales, zeros, 24)
    _, packed, scales, zeros = make_weight(48, 64, 32, seed=0)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16, got torch.float64"):
        triton_matmul(torch.randn(1, 64, dtype=torch.float64), packed, scales, zeros, 32)
    assert triton_matmul(torch.randn(0, 64), packed, scales, zeros, 32).shape == (0, 48)
    empty = torch.zeros(48, 0, dtype=torch.uint8), torch.zeros(48, 0), torch.zeros(48, 0)
    assert torch.equal(triton_matmul(torch.randn(2, 0), *empty, 32), torch.zeros(2, 48))


@needs_triton
def test_dispatch_forced_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatcher routes to the Triton kernel when forced, the reference otherwise."""
    from omnibus import kernels
    from omnibus.kernels.quant import triton_kernels
    from tests.kernels.launches import record_launches

    _, packed, scales, zeros = make_weight(48, IN_DIM, 64, seed=5)
    x = torch.randn(3, IN_DIM)
    launches = record_launches(monkeypatch, triton_kernels, "_int4_matmul_kernel")
    expected = int4_matmul_ref(x, packed, scales, zeros, 64)
    for force, count in (("0", 0), ("1", 1)):
        monkeypatch.setenv("OMNIBUS_FORCE_TRITON", force)
        y = kernels.int4_matmul(x, packed, scales, zeros, 64)
        assert len(launches) == count and max_err(y, expected) < 1e-4
    # (row tiles, 64-column tiles, splits): split-K stays off without CUDA's SM count
    assert launches[0].grid == (1, 1, 1)


@needs_triton
def test_compiles_for_sm90_on_tensor_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the interpreter cannot show: a bf16 decode launch compiles for an H100/H200
    (sm_90) with its dot on bf16 tensor cores (mma/wgmma .bf16). The float32 launch asks for
    full-precision dots ("ieee", not tf32: tests/kernels/test_kernels_precision.py shows what
    that compiles to); one compile only, it takes seconds."""
    from omnibus.kernels.quant import triton_kernels
    from tests.kernels.launches import record_launches, sm90_ptx

    launches = record_launches(monkeypatch, triton_kernels, "_int4_matmul_kernel")
    _, packed, scales, zeros = make_weight(64, IN_DIM, 128, seed=0)
    for dtype in (torch.bfloat16, torch.float32):
        triton_matmul(torch.randn(1, IN_DIM).to(dtype), packed, scales, zeros, 128)
    assert [launch.kwargs["DOT_PRECISION"] for launch in launches] == ["tf32", "ieee"]
    (ptx,) = sm90_ptx([("omnibus.kernels.quant.triton_kernels", "_int4_matmul_kernel", launches[0])])
    assert ".bf16" in ptx and ("mma.sync" in ptx or "wgmma" in ptx)
