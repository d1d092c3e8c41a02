"""A linear layer's weight as it is held in memory, whatever file it came from.

Every checkpoint format (Hugging Face safetensors at full precision, compressed-tensors,
GPTQ, AWQ, GGUF blocks) decodes each projection into one of four kinds; each kind knows
how to join the projections a layer fuses (q/k/v, gate/up: rows, the output dimension),
how to give its exact full-precision value back (`dequantize`, the reference every
quantized kernel is tested against) and take rows. Kernels (`quant.kernels`) multiply
them; the model file never sees which kind a layer holds.

Shapes follow nn.Linear: (out, in). Groups run along the input dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch


@dataclass
class DenseWeight:
    """Full precision (float32, bfloat16 or float16)."""

    w: torch.Tensor  # (out, in)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.w.to(dtype)



@dataclass
class _PerChannel:
    """Codes with one scale per output channel: w = q * scale."""

    q: torch.Tensor  # (out, in)
    scale: torch.Tensor  # (out,) float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)


@dataclass
class Int8Weight(_PerChannel):
    """Symmetric INT8 (q int8). `act_int8`: the checkpoint also quantizes activations
    (W8A8, dynamic per token)."""

    act_int8: bool = False


@dataclass
class Int4Weight:
    """4-bit codes q in [0, 15] with a scale and a zero per group of `group` input columns.

    Two conventions exist in the files people hold, kept as written so that `dequantize`
    is the format's own arithmetic: "sub" w = (q - zero) * scale (GPTQ, AWQ,
    compressed-tensors; zero may be a float), "affine" w = q * scale + zero (GGUF's
    Q4_1/Q4_K, where zero is the block's minimum). `perm`, when set, is GPTQ's act-order:
    the input columns of the checkpoint in the order their groups run (the kernel gathers
    x's columns by it), so groups are contiguous in q."""

    q: torch.Tensor  # (out, in) uint8 in [0, 15]
    scale: torch.Tensor  # (out, in // group) float32
    zero: torch.Tensor  # (out, in // group) float32
    group: int
    kind: str = "sub"  # "sub" | "affine"
    perm: torch.Tensor | None = None  # (in,) int64: checkpoint column of each of q's columns

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def torch_scales_and_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) in torch's int4 kernels' convention w = (q - 8) * scale + zero."""
        if self.kind == "affine":
            return self.scale, self.zero + 8 * self.scale
        return self.scale, (8 - self.zero) * self.scale

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight in the checkpoint's column order."""
        s = self.scale.repeat_interleave(self.group, dim=1)
        z = self.zero.repeat_interleave(self.group, dim=1)
        q = self.q.float()
        w = q * s + z if self.kind == "affine" else (q - z) * s
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)



@dataclass
class Fp8Weight(_PerChannel):
    """FP8 e4m3 codes (a per-tensor scale is broadcast to every channel). Activations are
    quantized per token at run time (W8A8 FP8)."""


Weight = Union[DenseWeight, Int8Weight, Int4Weight, Fp8Weight]


class WeightFormatError(ValueError):
    """Projections that cannot be held together, or a weight that cannot be quantized."""


def concat_rows(parts: Sequence[Weight]) -> Weight:
    """The projections a layer fuses (q, k, v or gate, up), stacked along the output
    dimension. They must be of one kind (and one group size and column order); a file
    that quantizes them differently is served dequantized by the caller."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(type(p) is not type(first) for p in parts):
        raise WeightFormatError("fused projections hold different weight kinds")
    if isinstance(first, DenseWeight):
        return DenseWeight(torch.cat([p.w for p in parts]))  # type: ignore[union-attr]
    if isinstance(first, (Int8Weight, Fp8Weight)):
        if isinstance(first, Int8Weight) and len({p.act_int8 for p in parts}) != 1:  # type: ignore[union-attr]
            raise WeightFormatError("fused projections quantize activations differently")
        q = torch.cat([p.q for p in parts])  # type: ignore[union-attr]
        scale = torch.cat([p.scale for p in parts])  # type: ignore[union-attr]
        return Int8Weight(q, scale, first.act_int8) if isinstance(first, Int8Weight) else Fp8Weight(q, scale)
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if len({(p.group, p.kind) for p in int4}) != 1 or not _same_perm(int4):
        raise WeightFormatError("fused projections use different groups or column orders")
    return Int4Weight(torch.cat([p.q for p in int4]), torch.cat([p.scale for p in int4]),
                      torch.cat([p.zero for p in int4]), first.group, first.kind, first.perm)  # type: ignore[union-attr]


def _same_perm(parts: Sequence[Int4Weight]) -> bool:
    perms = [p.perm for p in parts]
    if all(p is None for p in perms):
        return True
    return all(p is not None and torch.equal(p, perms[0]) for p in perms)  # type: ignore[arg-type]


def take_rows(weight: Weight, index: torch.Tensor) -> Weight:
    """The weight's output rows `index` (a reordering, or a tensor-parallel shard)."""
    if isinstance(weight, DenseWeight):
        return DenseWeight(weight.w[index])
    if isinstance(weight, Int4Weight):
        return Int4Weight(weight.q[index], weight.scale[index], weight.zero[index], weight.group,
                          weight.kind, weight.perm)
    if isinstance(weight, Int8Weight):
        return Int8Weight(weight.q[index], weight.scale[index], weight.act_int8)
    return Fp8Weight(weight.q[index], weight.scale[index])


def take_columns(weight: Weight, start: int, stop: int) -> Weight:
    """The weight's input columns [start, stop) of the checkpoint's order (a row-parallel
    tensor-parallel shard). A group-quantized weight splits on its group boundaries only,
    and an act-order one (GPTQ desc_act: groups run in another column order) not at all."""
    if isinstance(weight, DenseWeight):
        return DenseWeight(weight.w[:, start:stop])
    if isinstance(weight, (Int8Weight, Fp8Weight)):  # one scale per output row: unchanged
        q = weight.q[:, start:stop]
        return Int8Weight(q, weight.scale, weight.act_int8) if isinstance(weight, Int8Weight) else Fp8Weight(q, weight.scale)
    g = weight.group
    if weight.perm is not None:
        raise WeightFormatError("act-order (desc_act) INT4 groups do not follow the column order, so the "
                                "input columns cannot be split; serve it on one device or requantize without act-order")
    first, last = start // g, (stop - 1) // g
    if first == last and (start % g or stop - start < g):  # inside one group: a group of its own width
        g, groups = stop - start, slice(first, first + 1)
    elif start % g or stop % g:
        raise WeightFormatError(f"columns [{start}, {stop}) do not fall on the INT4 groups of {g} columns")
    else:
        groups = slice(first, last + 1)
    return Int4Weight(weight.q[:, start:stop], weight.scale[:, groups], weight.zero[:, groups], g, weight.kind)


# --- quantizing a full-precision weight at load (--quantization) ----------------------------

def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-channel INT8 by absolute maximum (round to nearest)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per-channel FP8 e4m3 by absolute maximum (the format's largest value is 448)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    return Fp8Weight((w / scale[:, None]).to(torch.float8_e4m3fn), scale)


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Weight:
    """Asymmetric INT4 per group of `group` input columns by min/max (round to nearest)."""
    out_f, in_f = w.shape
    if in_f % group:
        raise WeightFormatError(f"INT4 group size {group} does not divide the input dimension {in_f}")
    g = w.float().reshape(out_f, in_f // group, group)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.reshape(out_f, in_f), scale, lo, group, "affine")


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8, "int4": quantize_int4}
