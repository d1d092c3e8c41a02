"""compressed-tensors checkpoints (quant_method "compressed-tensors", what llm-compressor
writes), decoded into `quant.weights`.

The config's `config_groups` say which projections are quantized how (`targets`: "Linear",
module names or "re:" regexes; `ignore` takes modules back out, with compressed-tensors'
precedence: an exact name, then regexes, then the class), and each group's `format` (or the
config's) how the codes are stored:

| format          | tensors                                   | weight            |
|-----------------|-------------------------------------------|-------------------|
| float-quantized | weight (float8_e4m3fn), weight_scale      | Fp8Weight         |
| int-quantized   | weight (int8), weight_scale               | Int8Weight        |
| pack-quantized  | weight_packed (int32), weight_scale, weight_shape, [weight_zero_point], [weight_g_idx] | Int4Weight (4-bit), Int8Weight (8-bit) |

Scales are per tensor (1,), per channel (out, 1) or per group (out, in / group_size). The
packed codes are compressed-tensors' own layout (`pack_to_int32`): signed values offset by
2**(bits-1), code i of a row at bits 4i of word i // 8 (4-bit); asymmetric zero points are
packed the same way down the output dimension, (out / 8, groups). What is not served
(other bit widths, FP4 formats, FP8 blocks, sparsity, transforms, quantized activations of
a 4-bit scheme) is refused by name.
"""

from __future__ import annotations

import re
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
    is_projection,
    need,
    unpack,
)
from omnibus.engine.model.quant.weights import Fp8Weight, Int8Weight, Weight

_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_WEIGHT_PARAMS = {"weight", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape", "weight_g_idx"}
# Static activation scales (FP8/INT8 "static" schemes). Omnibus quantizes activations
# dynamically, one scale per token, which is at least as exact; the stored ones are unused.
_INPUT_PARAMS = {"input_scale", "input_zero_point"}
_ORDERINGS = (None, "weight", "static", "group", "dynamic")  # the last two store weight_g_idx


@dataclass(frozen=True)
class Scheme:
    """One config group, validated: how its projections' weights are stored."""

    group: str  # the config group's name, for messages
    format: str
    bits: int
    type: str  # "int" | "float"
    strategy: str  # "tensor" | "channel" | "group"
    group_size: int | None
    symmetric: bool
    actorder: str | None
    act_int8: bool  # input activations quantized to INT8 (W8A8)

    def where(self) -> str:
        return (f" (quantization_config.config_groups.{self.group}: {self.format}, {self.bits}-bit {self.type}, "
                f"strategy {self.strategy})")


def decode(tensors: Iterator[tuple[str, torch.Tensor]], qconfig: dict[str, Any],
           cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor | Weight]]:
    """The file's tensors with each quantized projection decoded (module doc)."""
    matcher = _Matcher(qconfig)

    def takes(module: str, param: str) -> bool:
        if matcher.scheme(module) is not None:
            return param != "bias"
        if param in _WEIGHT_PARAMS - {"weight"} or param in _INPUT_PARAMS:
            why = "is not a projection" if not is_projection(module) else "is not quantized by the quantization_config"
            raise ModelLoadError(f"{module}.{param}: {module} {why}, yet the file holds a quantized tensor for it")
        return False  # kv_cache_scheme's self_attn.k_scale / v_scale pass on to the loader

    def decode_module(module: str, parts: dict[str, torch.Tensor]) -> Weight | None:
        scheme = matcher.scheme(module)
        return None if scheme is None else _decode_module(module, parts, scheme)

    return decoded(tensors, takes, decode_module)


class _Matcher:
    """Which config group quantizes a module, as compressed-tensors matches them."""

    def __init__(self, qconfig: dict[str, Any]) -> None:
        _refuse_unserved(qconfig)
        groups = qconfig.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ModelLoadError("quantization_config.config_groups is missing or empty")
        self.targets: dict[str, Scheme] = {}  # a later group's target wins, as in compressed-tensors
        for name, group in groups.items():
            scheme = _scheme(name, group, qconfig.get("format"))
            for target in _strings(group.get("targets"), f"config_groups.{name}.targets"):
                self.targets[target] = scheme
        self.ignore = _strings(qconfig.get("ignore") or [], "ignore")
        self._memo: dict[str, Scheme | None] = {}

    def scheme(self, module: str) -> Scheme | None:
        if module not in self._memo:
            found = None
            if is_projection(module) and not _matches_any(module, self.ignore):
                ordered = sorted(self.targets, key=lambda t: ("re:" in t, t))  # names, then regexes
                named = [t for t in ordered if _name_matches(module, t)]
                classed = [t for t in ordered if t == "Linear"]
                hits = named + classed
                found = self.targets[hits[0]] if hits else None
            self._memo[module] = found
        return self._memo[module]


def _name_matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target == module


def _matches_any(module: str, targets: list[str]) -> bool:
    return any(t == "Linear" or _name_matches(module, t) for t in targets)


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelLoadError(f"quantization_config.{key} must be a list of module names or patterns")
    for v in value:
        try:
            re.compile(v.removeprefix("re:"))
        except re.error as exc:
            raise ModelLoadError(f"quantization_config.{key}: {v!r} is not a valid regex: {exc}") from None
    return value


def _refuse_unserved(qconfig: dict[str, Any]) -> None:
    sparsity = qconfig.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        raise ModelLoadError(f"quantization_config.sparsity_config: sparse format {sparsity.get('format')!r} "
                             "is not served")
    if qconfig.get("transform_config"):
        raise ModelLoadError("quantization_config.transform_config: weight transforms (rotations) are not served")
    status = qconfig.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelLoadError(f"quantization_config.quantization_status {status!r}: only compressed checkpoints "
                             "are served (the weights are not stored quantized)")


def _scheme(name: str, group: Any, default_format: Any) -> Scheme:
    where = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ModelLoadError(f"{where} must be an object")
    fmt = group.get("format") or default_format
    if fmt not in _FORMATS:
        raise ModelLoadError(f"{where}: format {fmt!r} is not served (served: {', '.join(_FORMATS)})")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ModelLoadError(f"{where}: no weights quantization (activation-only schemes are not served)")
    if group.get("output_activations"):
        raise ModelLoadError(f"{where}: output activation quantization is not served")
    bits, kind = w.get("num_bits", 8), w.get("type", "int")
    group_size = w.get("group_size")
    strategy = w.get("strategy") or ("group" if (group_size or 0) > 0 else "channel" if group_size == -1
                                     else "tensor")
    acts = group.get("input_activations")
    if acts is not None and not isinstance(acts, dict):
        raise ModelLoadError(f"{where}.input_activations must be an object or null")
    if acts is not None and (acts.get("num_bits", 8) != 8 or acts.get("type", "int") != kind):
        raise ModelLoadError(f"{where}: {acts.get('num_bits', 8)}-bit {acts.get('type', 'int')} input activations "
                             f"with {kind} weights are not served")
    scheme = Scheme(name, fmt, bits, kind, strategy, group_size, bool(w.get("symmetric", True)),
                    w.get("actorder"), acts is not None and kind == "int")
    _check_scheme(scheme, where, acts is not None)
    return scheme


def _check_scheme(s: Scheme, where: str, acts: bool) -> None:
    def refuse(reason: str) -> None:
        raise ModelLoadError(f"{where}: {reason} is not served")

    if s.format == "float-quantized" and (s.type, s.bits) != ("float", 8):
        refuse(f"float-quantized with {s.bits}-bit {s.type} weights")
    if s.format == "int-quantized" and (s.type, s.bits) != ("int", 8):
        refuse(f"int-quantized with {s.bits}-bit {s.type} weights")
    if s.format == "naive-quantized" and s.bits != 8:
        refuse(f"naive-quantized with {s.bits}-bit weights")
    if s.format == "pack-quantized" and (s.type != "int" or s.bits not in (4, 8)):
        refuse(f"pack-quantized {s.bits}-bit {s.type} weights (4 and 8-bit integers are)")
    if s.format == "pack-quantized" and acts:
        refuse("pack-quantized with quantized input activations (W4A8)")
    if s.strategy not in ("tensor", "channel", "group"):
        refuse(f"weight strategy {s.strategy!r}")
    if s.strategy == "group" and (s.bits != 4 or not isinstance(s.group_size, int) or s.group_size <= 0):
        refuse(f"strategy 'group' with {s.bits}-bit weights and group_size {s.group_size!r}")
    if not s.symmetric and (s.bits != 4 or s.strategy == "tensor"):
        refuse(f"asymmetric {s.bits}-bit weights with strategy {s.strategy!r}")
    if s.actorder not in _ORDERINGS:
        refuse(f"activation ordering {s.actorder!r}")


def _decode_module(module: str, parts: dict[str, torch.Tensor], s: Scheme) -> Weight:
    for param in parts:
        if param in _INPUT_PARAMS:
            continue  # static activation scales: see _INPUT_PARAMS
        if param not in _WEIGHT_PARAMS:
            raise ModelLoadError(f"unexpected tensor {module}.{param} for {s.format}{s.where()}")
    if s.format == "pack-quantized":
        return _packed(module, parts, s)
    if not s.symmetric or "weight_zero_point" in parts:
        raise ModelLoadError(f"{module}.weight_zero_point: asymmetric 8-bit weights are not served{s.where()}")
    q = need(module, parts, "weight", s.where())
    if q.dim() != 2:
        raise ModelLoadError(f"{module}.weight has shape {tuple(q.shape)}, expected (out, in){s.where()}")
    scale = _scale(module, parts, s, *q.shape)[:, 0]
    if s.type == "float":
        return Fp8Weight(check(f"{module}.weight", q, dtypes=(torch.float8_e4m3fn,), why=s.where()), scale)
    return Int8Weight(check(f"{module}.weight", q, dtypes=(torch.int8,), why=s.where()), scale, s.act_int8)


def _scale(module: str, parts: dict[str, torch.Tensor], s: Scheme, out_f: int, in_f: int) -> torch.Tensor:
    """weight_scale as (out, groups) float32: one group per row unless strategy "group"."""
    scale = check(f"{module}.weight_scale", need(module, parts, "weight_scale", s.where()),
                  dtypes=SCALE_DTYPES, why=s.where())
    if s.strategy == "tensor":
        if scale.numel() != 1:
            raise ModelLoadError(f"{module}.weight_scale has shape {tuple(scale.shape)}, expected (1,) "
                                 f"(one scale for the tensor){s.where()}")
        return scale.float().reshape(1, 1).expand(out_f, 1).contiguous()
    if s.strategy == "channel":
        if tuple(scale.shape) not in ((out_f, 1), (out_f,)):
            raise ModelLoadError(f"{module}.weight_scale has shape {tuple(scale.shape)}, expected ({out_f}, 1) "
                                 f"(one scale per output channel){s.where()}")
        return scale.float().reshape(out_f, 1)
    group = s.group_size or 0
    check_group(f"{module}.weight_scale", in_f, group)
    return check(f"{module}.weight_scale", scale, (out_f, in_f // group), why=s.where()).float()


def _packed(module: str, parts: dict[str, torch.Tensor], s: Scheme) -> Weight:
    shape = need(module, parts, "weight_shape", s.where())
    if shape.numel() != 2 or shape.dtype.is_floating_point:
        raise ModelLoadError(f"{module}.weight_shape must hold (out, in), got {shape.tolist()}")
    out_f, in_f = (int(v) for v in shape.tolist())
    per_word = 32 // s.bits
    if in_f % per_word:
        raise ModelLoadError(f"{module}: input dimension {in_f} is not a multiple of {per_word} "
                             f"({s.bits}-bit codes packed in int32){s.where()}")
    packed = check(f"{module}.weight_packed", need(module, parts, "weight_packed", s.where()),
                   (out_f, in_f // per_word), (torch.int32,), s.where())
    codes = unpack(packed, s.bits, 1)  # (out, in): the signed value + 2**(bits-1)
    scale = _scale(module, parts, s, out_f, in_f)
    if s.bits == 8:
        return Int8Weight((codes.to(torch.int16) - 128).to(torch.int8), scale[:, 0])
    groups = scale.shape[1]
    if s.symmetric:
        zero = torch.full_like(scale, 8.0)
    else:
        zp = check(f"{module}.weight_zero_point", need(module, parts, "weight_zero_point", s.where()),
                   (-(-out_f // 8), groups), (torch.int32,), s.where())
        zero = unpack(zp, 4, 0)[:out_f].float()  # (out, groups): the signed zero point + 8
    return int4_groups(f"{module}.weight_g_idx", codes, scale, zero, _g_idx(module, parts, s, in_f))


def _g_idx(module: str, parts: dict[str, torch.Tensor], s: Scheme, in_f: int) -> torch.Tensor | None:
    if "weight_g_idx" not in parts:
        if s.actorder in ("group", "dynamic"):
            need(module, parts, "weight_g_idx", f" (actorder {s.actorder!r} stores each column's group)")
        return None
    return check(f"{module}.weight_g_idx", parts["weight_g_idx"], (in_f,), (torch.int32, torch.int64), s.where())
