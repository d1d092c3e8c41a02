"""GPTQ (AutoGPTQ, GPTQModel) and AWQ (AutoAWQ) checkpoints, decoded into `quant.weights`.

Both store each quantized projection as int32 words of 4-bit codes with per-group scales
and zeros, w = (q - zero) * scale, but lay them out differently:

| tensor  | GPTQ                                       | AWQ ("gemm")                        |
|---------|--------------------------------------------|-------------------------------------|
| qweight | (in / 8, out): 8 input rows per word       | (in, out / 8): 8 output columns per word, nibble i holding column [0,2,4,6,1,3,5,7][i] |
| qzeros  | (groups, out / 8), plain order; checkpoint_format "gptq" (v1) stores zero - 1, "gptq_v2" the zero | (groups, out / 8), interleaved as qweight |
| scales  | (groups, out)                              | (groups, out)                       |
| g_idx   | (in,): each input column's group (act-order, desc_act) | -                        |

GPTQ's act-order is honoured as vLLM and ExLlama do: input columns sorted by group
(`Int4Weight.perm`). GPTQ's 8-bit codes (4 per word) become Int8Weight when there is one
group per row (group_size -1) and the zeros are the symmetric 128; anything else at 8 bits,
2 or 3 bits, GPTQModel's per-module `dynamic` overrides and AWQ's other versions (GEMV's
packing differs) are refused by name. group_size -1 is one group spanning the input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.engine.model.formats.packed import (
    SCALE_DTYPES,
    check,
    check_group,
    decoded,
    int4_groups,
    need,
    taking,
    unpack,
)
from omnibus.engine.model.quant.weights import Int8Weight, Weight

_GPTQ_PARAMS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
_AWQ_PARAMS = frozenset({"qweight", "qzeros", "scales"})
_AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # column c of each 8 sits in nibble _AWQ_UNDO[c]


@dataclass(frozen=True)
class _Gptq:
    bits: int  # 4 | 8
    group_size: int  # -1: one group spanning the input
    desc_act: bool
    zero_offset: int  # added to a stored zero: 1 for v1 ("gptq"), 0 for "gptq_v2"

    def where(self) -> str:
        return f" (GPTQ {self.bits}-bit, group_size {self.group_size})"


def decode_gptq(tensors: Iterator[tuple[str, torch.Tensor]], qconfig: dict[str, Any],
                cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | Weight]]:
    """A GPTQ checkpoint's tensors with each quantized projection decoded (module doc)."""
    spec = _gptq_config(qconfig)
    return decoded(tensors, taking(_GPTQ_PARAMS), lambda module, parts: _gptq_module(module, parts, spec))


def _gptq_config(qconfig: dict[str, Any]) -> _Gptq:
    bits, group_size = qconfig.get("bits"), qconfig.get("group_size", -1)
    if bits not in (4, 8):
        raise ModelLoadError(f"quantization_config.bits {bits!r}: GPTQ at {bits} bits is not served (4 and 8 are)")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ModelLoadError(f"quantization_config.group_size {group_size!r} must be a positive size or -1")
    if bits == 8 and group_size != -1:
        raise ModelLoadError(f"quantization_config: 8-bit GPTQ in groups of {group_size} is not served "
                             "(INT8 weights have one scale per output channel: group_size -1)")
    fmt = qconfig.get("checkpoint_format") or qconfig.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"quantization_config.checkpoint_format {fmt!r} is not served (gptq, gptq_v2 are)")
    if qconfig.get("dynamic"):
        raise ModelLoadError("quantization_config.dynamic: GPTQModel's per-module overrides are not served")
    return _Gptq(bits, group_size, bool(qconfig.get("desc_act")), 1 if fmt == "gptq" else 0)


def _gptq_module(module: str, parts: dict[str, torch.Tensor], spec: _Gptq) -> Weight:
    where = spec.where()
    qweight = check(f"{module}.qweight", need(module, parts, "qweight", where), dtypes=(torch.int32,), why=where)
    per_word = 32 // spec.bits
    if qweight.dim() != 2:
        raise ModelLoadError(f"{module}.qweight has shape {tuple(qweight.shape)}, expected (in / {per_word}, out)")
    in_f, out_f = qweight.shape[0] * per_word, qweight.shape[1]
    groups = _groups(f"{module}.qweight", in_f, spec.group_size)
    scale, zero = _scales_and_zeros(module, parts, groups, out_f, spec.bits, where)
    codes = unpack(qweight, spec.bits, 0).t()  # (out, in)
    zero = unpack(zero, spec.bits, 1).t().float() + spec.zero_offset  # (out, groups)
    g_idx = parts.get("g_idx")
    if g_idx is None and spec.desc_act:
        need(module, parts, "g_idx", " (desc_act: each input column's group)")
    if g_idx is not None:
        check(f"{module}.g_idx", g_idx, (in_f,), (torch.int32, torch.int64), where)
    if spec.bits == 8:  # one group (config-checked): g_idx is all zeros
        if not bool((zero == 128).all()):
            raise ModelLoadError(f"{module}.qzeros: asymmetric 8-bit GPTQ is not served (INT8 weights are "
                                 "symmetric: zero 128)")
        return Int8Weight((codes.to(torch.int16) - 128).to(torch.int8), scale[:, 0])
    return int4_groups(f"{module}.g_idx", codes.contiguous(), scale, zero, g_idx)


def _groups(name: str, in_f: int, group_size: int) -> int:
    group = in_f if group_size == -1 else group_size
    check_group(name, in_f, group)
    return in_f // group


def _scales_and_zeros(module: str, parts: dict[str, torch.Tensor], groups: int, out_f: int, bits: int,
                      where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scales as (out, groups) float32; qzeros checked, still packed (groups, out * bits / 32)."""
    per_word = 32 // bits
    if out_f % per_word:
        raise ModelLoadError(f"{module}: output dimension {out_f} is not a multiple of {per_word}, "
                             f"so its zeros cannot be packed{where}")
    scales = check(f"{module}.scales", need(module, parts, "scales", where), (groups, out_f), SCALE_DTYPES, where)
    qzeros = check(f"{module}.qzeros", need(module, parts, "qzeros", where), (groups, out_f // per_word),
                   (torch.int32,), where)
    return scales.float().t().contiguous(), qzeros


def decode_awq(tensors: Iterator[tuple[str, torch.Tensor]], qconfig: dict[str, Any],
               cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | Weight]]:
    """An AWQ checkpoint's tensors with each quantized projection decoded (module doc)."""
    group_size = _awq_config(qconfig)
    return decoded(tensors, taking(_AWQ_PARAMS), lambda module, parts: _awq_module(module, parts, group_size))


def _awq_config(qconfig: dict[str, Any]) -> int:
    bits = qconfig.get("bits", qconfig.get("w_bit"))
    group_size = qconfig.get("group_size", qconfig.get("q_group_size"))
    version = str(qconfig.get("version", "gemm")).lower()
    if bits != 4:
        raise ModelLoadError(f"quantization_config.bits {bits!r}: AWQ at {bits} bits is not served (4 is)")
    if version != "gemm":
        raise ModelLoadError(f"quantization_config.version {version!r}: AWQ's {version} layout is not served "
                             "(gemm is)")
    if not qconfig.get("zero_point", True):
        raise ModelLoadError("quantization_config.zero_point false: AWQ without zero points is not served")
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise ModelLoadError(f"quantization_config.group_size {group_size!r} must be a positive size or -1")
    return group_size


def _awq_module(module: str, parts: dict[str, torch.Tensor], group_size: int) -> Weight:
    where = f" (AWQ 4-bit gemm, group_size {group_size})"
    qweight = check(f"{module}.qweight", need(module, parts, "qweight", where), dtypes=(torch.int32,), why=where)
    if qweight.dim() != 2:
        raise ModelLoadError(f"{module}.qweight has shape {tuple(qweight.shape)}, expected (in, out / 8)")
    in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(f"{module}.qweight", in_f, group_size)
    scale, qzeros = _scales_and_zeros(module, parts, groups, out_f, 4, where)
    codes = _awq_columns(unpack(qweight, 4, 1)).t().contiguous()  # (out, in)
    zero = _awq_columns(unpack(qzeros, 4, 1)).t().float()  # (out, groups)
    return int4_groups(f"{module}.qweight", codes, scale, zero, None)


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """(rows, out) codes in AWQ's nibble order -> in column order."""
    rows, out_f = codes.shape
    return codes.reshape(rows, out_f // 8, 8)[:, :, _AWQ_UNDO].reshape(rows, out_f)
