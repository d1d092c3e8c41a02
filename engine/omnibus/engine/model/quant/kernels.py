"""How each weight kind is multiplied, on the CPU and on CUDA.

One `make_kernel(weight, device)` picks the product for a layer once, after loading;
the layer then calls it every step. torch's INT8/INT4 weight-only CPU kernels are fast
with bfloat16 activations and were 14-56x slower with float32 ones (one micro-benchmark
on the 2-core VM, SmolLM2's shapes, 1 and 16 rows), so they are fed bfloat16 and give the
layer's dtype back.

| kind  | CPU                                   | CUDA                                   |
|-------|---------------------------------------|----------------------------------------|
| int8  | aten._weight_int8pack_mm (bf16 x)     | dequantized per call (no INT8 kernel)  |
| int8 + act_int8 (W8A8) | per-token INT8 x, aten._int_mm | the same                         |
| int4  | aten._weight_int4pack_mm_for_cpu      | kernels.int4_matmul (Triton)           |
| fp8   | torch._scaled_mm, per-token x scales  | the same                               |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnibus.engine.model.quant.weights import DenseWeight, Fp8Weight, Int4Weight, Int8Weight, Weight

_CPU_INT4_N = 16  # torch's CPU int4 packing wants the output dimension in multiples of 16
_CPU_INT4_GROUPS = (32, 64, 128, 256)
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class Kernel(nn.Module):
    """y = x @ w.T for one weight kind (no bias: the layer adds it). A module so that its
    tensors are buffers: `state_dict`, memory accounting and `.to()` see them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class Int8CpuKernel(Kernel):
    def __init__(self, w: Int8Weight, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.act_dtype = act_dtype
        self.register_buffer("q", w.q.contiguous())
        self.register_buffer("scale", w.scale.to(act_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.act_dtype:  # a bfloat16 model: no casts
            return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)
        return torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype), self.q, self.scale).to(x.dtype)


class Int8DequantKernel(Kernel):
    """INT8 weight-only where no INT8 kernel serves: the weight stays INT8 in memory and is
    widened each call (correct, memory-saving, not fast)."""

    def __init__(self, w: Int8Weight) -> None:
        super().__init__()
        self.register_buffer("q", w.q)
        self.register_buffer("scale", w.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.q.to(x.dtype) * self.scale.to(x.dtype)[:, None])


class W8A8Kernel(Kernel):
    """INT8 weights and INT8 activations (one dynamic scale per token): an int32
    accumulation through aten._int_mm, rescaled by both scales."""

    def __init__(self, w: Int8Weight) -> None:
        super().__init__()
        self.register_buffer("qt", w.q.t().contiguous().t())  # (out, in) stored column-major for x @ qt.T
        self.register_buffer("scale", w.scale.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = (xf.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)  # (T, 1)
        xq = torch.round(xf / sx).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(xq, self.qt.t())  # (T, out) int32
        return (acc.float() * sx * self.scale[None, :]).to(x.dtype)


class Int4CpuKernel(Kernel):
    def __init__(self, w: Int4Weight, act_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        out_f = w.q.shape[0]
        pad = -out_f % _CPU_INT4_N
        scale, zero = w.torch_scales_and_zeros()
        q = w.q.to(torch.int32)
        if pad:  # zero rows (scale 0, zero 0), sliced off after the product
            q = torch.cat([q, torch.full((pad, q.shape[1]), 8, dtype=torch.int32)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
        self.out_features, self.group, self.act_dtype, self.padded = out_f, w.group, act_dtype, pad > 0
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # (in // group, out, 2): the kernel's layout of scales and zeros
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1)
                             .contiguous().to(act_dtype))
        self.register_buffer("perm", w.perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xa = x if x.dtype == self.act_dtype else x.to(self.act_dtype)
        if self.perm is not None:
            xa = xa.index_select(1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xa, self.packed, self.group, self.scales_and_zeros)
        if self.padded:
            y = y[:, :self.out_features]
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Int4TritonKernel(Kernel):
    """W4A16 through kernels.int4_matmul (a Triton dequantize-and-multiply kernel)."""

    def __init__(self, w: Int4Weight) -> None:
        super().__init__()
        from omnibus.kernels.quant.reference import pack_int4

        scale, zero = w.torch_scales_and_zeros()
        self.group = w.group
        self.register_buffer("packed", pack_int4(w.q))
        self.register_buffer("scales", scale.float().contiguous())
        self.register_buffer("zeros", zero.float().contiguous())
        self.register_buffer("perm", w.perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from omnibus.kernels import int4_matmul

        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return int4_matmul(x, self.packed, self.scales, self.zeros, self.group)


class Fp8Kernel(Kernel):
    """FP8 e4m3 weights, activations quantized per token at run time, torch._scaled_mm with
    row-wise scales (CPU and CUDA; on CUDA it needs dimensions in multiples of 16)."""

    def __init__(self, w: Fp8Weight) -> None:
        super().__init__()
        self.register_buffer("qt", w.q.t())  # (in, out), column-major: _scaled_mm's second operand
        self.register_buffer("scale", w.scale.float()[None, :].contiguous())  # (1, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sx = (xf.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp(min=1e-12)  # (T, 1)
        xq = (xf / sx).to(torch.float8_e4m3fn)
        out_dtype = torch.bfloat16 if x.is_cuda else torch.float32
        return torch._scaled_mm(xq, self.qt, sx, self.scale, out_dtype=out_dtype).to(x.dtype)


def make_kernel(weight: Weight, device: torch.device) -> Kernel | None:
    """The product for `weight` on `device`; None for a dense weight (the layer's own
    nn.Linear-style matmul, oneDNN-packed on the CPU where configured)."""
    if isinstance(weight, DenseWeight):
        return None
    cpu = device.type == "cpu"
    if isinstance(weight, Int8Weight):
        if weight.act_int8:
            return W8A8Kernel(weight)
        return Int8CpuKernel(weight) if cpu else Int8DequantKernel(weight)
    if isinstance(weight, Int4Weight):
        if cpu and weight.group in _CPU_INT4_GROUPS:
            return Int4CpuKernel(weight)
        return Int4TritonKernel(weight)
    return Fp8Kernel(weight)
