"""Weights of a GGUF file (llama.cpp's format), as (Hugging Face name, tensor or weight) pairs.

The file's directory is read by `omnibus.common.model_files` and its tensors are mapped,
not read whole; the `gguf` package decodes block types. Projections in Q4_0, Q4_1 or
Q4_K keep their 4-bit codes (`Int4Weight`, groups of 32: the blocks' own scales and
minimums, exactly); every other type (F32, F16, BF16, Q8_0, Q5_*, Q6_K, ...) is dequantized
once at load by gguf's own code, as transformers does, and logged with its cost. Under
`--quantization none` everything is dequantized by gguf, so the weights are bit for bit
what transformers loads from the same file.

llama.cpp's converter permutes the rows of q and k projections in files of its "llama"
architecture (Llama, and Mistral written as it; its rotary embedding pairs adjacent
dimensions, Hugging Face's pairs halves); they are permuted back here, for the quantized
codes as for dense rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import structlog
import torch

from omnibus.common.model_files import GgufFiles, GgufTensor, open_model
from omnibus.engine.config import ModelConfig, ModelLoadError
from omnibus.engine.model.quant.weights import Int4Weight, Weight, take_rows

log = structlog.get_logger(__name__)

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs"}  # Llama 3.1 rope factors: read into the config (rope_scaling freq_factors)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one the model computes itself."""
    match = _BLOCK.match(name)
    if match:
        layer, kind, suffix = match.groups()
        if kind in _LAYER:
            return f"model.layers.{layer}.{_LAYER[kind]}.{suffix}"
    else:
        base, _, suffix = name.rpartition(".")
        if base in _GLOBAL and suffix in ("weight", "bias"):
            return f"{_GLOBAL[base]}.{suffix}"
        if base in _IGNORED:
            return None
    raise ModelLoadError(f"unexpected tensor {name!r} in the GGUF file (not a Llama-family weight)")


def gguf_weights(path: Path, cfg: ModelConfig, dequantize_all: bool) -> Iterator[tuple[str, torch.Tensor | Weight]]:
    """Every tensor of the file under its Hugging Face name (see the module doc)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        files = open_model(path)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    assert isinstance(files, GgufFiles)  # a .gguf path opens as one
    data = np.memmap(path, dtype=np.uint8, mode="r")
    # llama.cpp permutes q/k for its "llama" architecture, Mistral files written as it
    # included (transformers keys the undoing on the file's architecture too)
    permuted = files.header.metadata.get("general.architecture") == "llama"
    widened = 0
    for tensor_name, info in files.header.tensors.items():
        name = hf_name(tensor_name)
        if name is None:
            continue
        try:
            qtype = GGMLQuantizationType(info.type_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {tensor_name} has unknown GGUF type {info.type_id}") from None
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row = info.shape[0]
        rows = int(np.prod(info.shape[1:], dtype=np.int64))
        if row % block:
            raise ModelLoadError(f"{path}: tensor {tensor_name} rows of {row} are not whole {qtype.name} blocks")
        nbytes = rows * row // block * block_bytes
        if info.offset + nbytes > data.size:
            raise ModelLoadError(f"{path} is truncated: tensor {tensor_name} ends past the end of the file")
        raw = data[info.offset:info.offset + nbytes].reshape(rows, -1)
        projection = name.endswith("_proj.weight") or name == "lm_head.weight"
        weight: torch.Tensor | Weight
        if projection and not dequantize_all and qtype.name in _INT4_DECODERS:
            weight = _int4(raw, qtype.name, rows)
        else:
            weight = _dequantized(raw, qtype, info, tensor_name, path)
            if qtype.name not in ("F32", "F16", "BF16"):
                widened += weight.numel() * 4 - nbytes
        if permuted and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            weight = _unpermute(weight, heads)
        yield name, weight
    if widened:
        log.info("gguf_dequantized", file=str(path), extra_bytes=widened,
                 detail="tensors of types without an Omnibus kernel are held dequantized in float32 at load")


def gguf_head_quantized(path: Path) -> bool:
    """Whether the file stores its LM head (`output.weight`, else the tied `token_embd`)
    in a quantized type."""
    tensors = open_model(path).header.tensors  # type: ignore[attr-defined]
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    return head is not None and head.type_id not in _FLOAT_TYPES


_FLOAT_TYPES = (0, 1, 30)  # ggml F32, F16, BF16


def _dequantized(raw: np.ndarray, qtype, info: GgufTensor, tensor_name: str, path: Path) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        values = dequantize(raw, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"{path}: tensor {tensor_name} has GGUF type {qtype.name}, which cannot be read: "
                             f"{exc}") from exc
    shape = tuple(reversed(info.shape))  # GGUF lists the fastest dimension first
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)  # a copy: the file is mapped read-only


def _unpermute(weight: torch.Tensor | Weight, heads: int) -> torch.Tensor | Weight:
    """Undo llama.cpp's q/k row order (its convert script's permute) on a (rows, in) weight."""
    rows = weight.shape[0]
    idx = torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, torch.Tensor):
        return weight[idx]
    return take_rows(weight, idx)


# --- 4-bit blocks kept as codes --------------------------------------------------------------

def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """(blocks, chunks * width/2) packed bytes -> (blocks, chunks * width) codes: each chunk's
    low nibbles are its first width/2 values, its high nibbles the rest (llama.cpp's order)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q4_0(blocks: np.ndarray):
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    q = _nibbles(blocks[:, 2:], 32)
    return q, d, np.full_like(d, 8.0), "sub"  # w = d * (q - 8)


def _q4_1(blocks: np.ndarray):
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 4:], 32), d, m, "affine"  # w = d * q + m


def _q4_k(blocks: np.ndarray):
    from gguf.quants import Q4_K

    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:4 + Q4_K.K_SCALE_SIZE].copy())
    q = _nibbles(blocks[:, 4 + Q4_K.K_SCALE_SIZE:], 64)  # chunks of 64: 32 low, then 32 high
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), "affine"  # w = d*sc*q - dmin*m


_INT4_DECODERS = {"Q4_0": (_q4_0, 18), "Q4_1": (_q4_1, 20), "Q4_K": (_q4_k, 144)}


def _int4(data: np.ndarray, kind: str, rows: int) -> Int4Weight:
    decode, block_bytes = _INT4_DECODERS[kind]
    q, scale, zero, convention = decode(np.asarray(data).reshape(-1, block_bytes))
    return Int4Weight(torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(scale.reshape(rows, -1)),
                      torch.from_numpy(zero.reshape(rows, -1)), 32, convention)
