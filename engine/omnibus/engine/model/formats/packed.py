"""What the quantized safetensors readers (compressed-tensors, GPTQ, AWQ) share.

A projection's tensors (codes, scales, zeros, group indices) may come in any order and
from any shard, so `decoded` holds them until the stream ends (they are small) while the
rest of the file passes through. `unpack` widens int32 words into the codes they hold,
and `int4_groups` turns codes, per-group scales and zeros and an optional act-order group
index into an `Int4Weight`. Every refusal is a ModelLoadError that names the tensor.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from omnibus.engine.config import ModelLoadError
from omnibus.engine.model.quant.weights import Int4Weight, Weight

# The modules a quantized checkpoint may quantize: Llama's linear projections.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(module: str) -> bool:
    return module == "lm_head" or module.rpartition(".")[2] in PROJECTIONS


def decoded(tensors: Iterable[tuple[str, torch.Tensor]], takes: Callable[[str, str], bool],
            decode: Callable[[str, dict[str, torch.Tensor]], Weight | None],
            ) -> Iterator[tuple[str, torch.Tensor | Weight]]:
    """The file's tensors, except those `takes(module, parameter)` wants: those are held by
    module until the stream ends, then each module's `decode(module, {parameter: tensor})`
    comes as its `weight` (None: the module's tensors are dropped)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, param = name.rpartition(".")
        if takes(module, param):
            pending.setdefault(module, {})[param] = tensor
        else:
            yield name, tensor
    for module, parts in pending.items():
        weight = decode(module, parts)
        if weight is not None:
            yield f"{module}.weight", weight


def taking(params: frozenset[str]) -> Callable[[str, str], bool]:
    """`decoded`'s test for a format whose quantized tensors have names of their own
    (GPTQ's qweight, ...): those are taken, and only from a projection."""
    def takes(module: str, param: str) -> bool:
        if param not in params:
            return False
        if not is_projection(module):
            raise ModelLoadError(f"{module}.{param}: {module} is not a linear projection, yet the file "
                                 "holds a quantized tensor for it")
        return True

    return takes


def need(module: str, tensors: dict[str, torch.Tensor], param: str, why: str = "") -> torch.Tensor:
    """A module's tensor, or a refusal that names the missing one."""
    if param not in tensors:
        raise ModelLoadError(f"{module}.{param} is missing from the checkpoint{why}")
    return tensors[param]


def check(name: str, tensor: torch.Tensor, shape: tuple[int, ...] | None = None,
          dtypes: tuple[torch.dtype, ...] | None = None, why: str = "") -> torch.Tensor:
    """Refuse a tensor of another shape or dtype than the format stores."""
    if dtypes is not None and tensor.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelLoadError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
                             f"the format stores {names}{why}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}{why}")
    return tensor


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits codes each along `dim` -> the codes (uint8), the word's
    i-th code at bits [i*bits, (i+1)*bits) (the layout GPTQ, AWQ and compressed-tensors
    share at 4 and 8 bits; AWQ also interleaves its columns, which it undoes itself)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.movedim(dim, -1).unsqueeze(-1)  # (..., words, 1)
    codes = (w >> shifts) & ((1 << bits) - 1)  # (..., words, 32 / bits)
    return codes.reshape(*w.shape[:-2], -1).movedim(-1, dim).to(torch.uint8).contiguous()


def check_group(name: str, in_features: int, group: int) -> None:
    if group <= 0 or in_features % group:
        raise ModelLoadError(f"{name}: group size {group} does not divide the input dimension {in_features}")


def int4_groups(name: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                g_idx: torch.Tensor | None) -> Int4Weight:
    """Codes (out, in) in the checkpoint's column order, scale and zero (out, groups), and
    each input column's group (`g_idx`, act-order; None: column // group) -> Int4Weight
    with w = (q - zero) * scale. An act-order index is honoured as vLLM and ExLlama do:
    the columns are sorted by group (stably) so each group is contiguous, and `perm`
    remembers the sort for the kernel's gather of x."""
    in_features, groups = codes.shape[1], scale.shape[1]
    group = in_features // groups
    natural = torch.arange(in_features) // group
    if g_idx is None or torch.equal(g_idx.long(), natural):
        return Int4Weight(codes, scale, zero, group)
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ModelLoadError(f"{name} holds group indices outside [0, {groups})")
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], natural):
        raise ModelLoadError(f"{name} does not give each of the {groups} groups {group} input columns")
    return Int4Weight(codes[:, perm].contiguous(), scale, zero, group, "sub", perm)
