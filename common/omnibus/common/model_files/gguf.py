"""A GGUF file's metadata as the files of a model directory: the config as transformers
reads a GGUF (`{arch}.*` keys)."""

from __future__ import annotations

import struct
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, TypeVar

from omnibus.common.model_files.base import ModelFiles
from omnibus.common.model_files.gguf_header import GgufHeader, GgufTensor, or_default, read_header
from omnibus.common.model_files.gguf_tokenizer import (
    TOKEN_ID_KEYS,
    gguf_tokenizer,
    gguf_tokenizer_config,
    token_strings,
)

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # general.architecture values served
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30  # the ggml types of plain float tensors

_T = TypeVar("_T")


class GgufFiles(ModelFiles):
    """A GGUF file's metadata as the files of a model directory."""

    def __init__(self, path: Path, header: GgufHeader) -> None:
        super().__init__(path)
        self._header = header

    @property
    def header(self) -> GgufHeader:
        """The file's metadata and tensor directory (what a weight loader maps from)."""
        return self._header

    def config(self) -> dict[str, Any]:
        return _gguf_config(self._header)

    def generation_config(self) -> dict[str, Any] | None:
        """End-of-turn and end-of-message ids beside the eos id, where the file lists them:
        llama.cpp stops at each (Llama 3's <|eot_id|>); None when there is only eos."""
        ids = [self._header.get(f"tokenizer.ggml.{key}_token_id", int) for key in ("eos", "eot", "eom")]
        if ids[1:] == [None, None]:
            return None  # the config's eos_token_id says it all
        return {"eos_token_id": list(dict.fromkeys(i for i in ids if i is not None))}

    @cached_property
    def _tokenizer(self) -> str:
        return gguf_tokenizer(self._header, self.tokenizer_config())

    def tokenizer_json(self) -> str:
        return self._tokenizer

    def tokenizer_config(self) -> dict[str, Any]:
        return gguf_tokenizer_config(self._header)

    def special_tokens_map(self) -> dict[str, Any]:
        return {}

    def chat_template(self) -> object:
        return self._header.get("tokenizer.chat_template", str)

    def file_for(self, name: str) -> Path:
        return self.path


@lru_cache(maxsize=4)
def open_gguf(path: str, mtime_ns: int, size: int) -> GgufFiles:
    """One parse per version of a file (the arguments after the path key the cache)."""
    return GgufFiles(Path(path), read_header(Path(path)))


def _architecture(header: GgufHeader) -> str:
    arch = header.need("general.architecture", str)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{header.path}: unsupported architecture {arch!r} (general.architecture); "
                         f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch


def _gguf_config(header: GgufHeader) -> dict[str, Any]:
    """config.json as transformers reads this file (its `{arch}.*` keys), with what
    llama.cpp does where transformers leaves a class default."""
    arch = _architecture(header)

    def need(key: str, kind: type[_T]) -> _T:
        return header.need(f"{arch}.{key}", kind)

    heads = need("attention.head_count", int)
    vocab_size = header.get(f"{arch}.vocab_size", int)
    config: dict[str, Any] = {
        # llama.cpp writes Mistral as "llama"; transformers tells it by the file's name
        "model_type": "mistral" if arch == "llama" and header.get("general.name", str) == "mistral" else arch,
        "vocab_size": vocab_size if vocab_size is not None else len(token_strings(header)),
        "hidden_size": need("embedding_length", int),
        "intermediate_size": need("feed_forward_length", int),
        "num_hidden_layers": need("block_count", int),
        "num_attention_heads": heads,
        # absent: one per query head (llama.cpp's default)
        "num_key_value_heads": or_default(header.get(f"{arch}.attention.head_count_kv", int), heads),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon", float),
        "rope_theta": or_default(header.get(f"{arch}.rope.freq_base", float), 10000.0),
        "max_position_embeddings": need("context_length", int),
        # llama.cpp writes output.weight only when it is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "torch_dtype": _torch_dtype(header.tensors),
    }
    if config["model_type"] == "mistral":  # llama.cpp attends to the whole context: no window
        config["sliding_window"] = None
    config.update(_head_dim(header, arch, config))
    config.update(_rope_scaling(header, arch))
    config.update({f"{name}_token_id": token for name in ("bos", "eos", "pad")
                   if (token := header.get(f"tokenizer.ggml.{TOKEN_ID_KEYS[name]}", int)) is not None})
    return config


def _head_dim(header: GgufHeader, arch: str, config: dict[str, Any]) -> dict[str, int]:
    """head_dim where the file states it: attention.key_length, else (Llama, Mistral, as
    transformers reads them) rope.dimension_count. The heads are key_length wide, else
    hidden / heads (llama.cpp); a rotary width other than the head's is partial rotary
    embeddings, another model, refused as llama.cpp refuses it."""
    rotary = header.get(f"{arch}.rope.dimension_count", int)
    key_length = header.get(f"{arch}.attention.key_length", int)
    size = key_length or config["hidden_size"] // max(config["num_attention_heads"], 1)
    if rotary is not None and rotary != size:
        raise ValueError(f"{header.path}: {arch}.rope.dimension_count is {rotary} where the heads have {size} "
                         "channels: partial rotary embeddings are not supported")
    head_dim = key_length or (rotary if arch != "qwen2" else None)
    return {"head_dim": head_dim} if head_dim is not None else {}


def _rope_scaling(header: GgufHeader, arch: str) -> dict[str, Any]:
    """rope.scaling.* as config.json's rope_scaling. A rope_freqs.weight tensor is how
    llama.cpp stores Llama 3.1's scaling: one float32 factor per rotary frequency, each
    frequency divided by its factor (llama.cpp's `freq_factors`); it becomes rope_scaling
    {"rope_type": "freq_factors", "factors": [...]} (the engine applies exactly that),
    alone: beside another scaling type llama.cpp would apply both, which no config.json says."""
    kind = header.get(f"{arch}.rope.scaling.type", str)
    tensor = header.tensors.get("rope_freqs.weight")
    if tensor is not None:
        if kind not in (None, "none"):
            raise ValueError(f"{header.path} has both a rope_freqs.weight tensor and {arch}.rope.scaling.type "
                             f"{kind!r}: rotary scaling by both is not supported")
        return {"rope_scaling": {"rope_type": "freq_factors", "factors": _float32_values(header, tensor)}}
    if kind in (None, "none"):
        return {}
    scaling = {"rope_type": kind, "factor": header.get(f"{arch}.rope.scaling.factor", float),
               "original_max_position_embeddings": header.get(f"{arch}.rope.scaling.original_context_length", int)}
    return {"rope_scaling": {k: v for k, v in scaling.items() if v is not None}}


def _float32_values(header: GgufHeader, tensor: GgufTensor) -> list[float]:
    """A small one-dimensional F32 tensor's values, read from the file."""
    if tensor.type_id != _GGML_F32 or len(tensor.shape) != 1:
        raise ValueError(f"{header.path}: rope_freqs.weight must be a one-dimensional F32 tensor, "
                         f"got ggml type {tensor.type_id} of shape {list(tensor.shape)}")
    count = tensor.shape[0]
    with header.path.open("rb") as file:
        file.seek(tensor.offset)
        data = file.read(4 * count)
    if len(data) != 4 * count:
        raise ValueError(f"{header.path} is truncated: rope_freqs.weight's {count} values are not all there")
    return list(struct.unpack(f"<{count}f", data))


def _torch_dtype(tensors: dict[str, GgufTensor]) -> str:
    """The dtype a file of plain float tensors was written in (its half type; the norms
    stay float32 beside it); float32 for quantized blocks, as transformers loads them."""
    kinds = {tensor.type_id for tensor in tensors.values()}
    if not kinds <= {_GGML_F32, _GGML_F16, _GGML_BF16}:
        return "float32"
    return "bfloat16" if _GGML_BF16 in kinds else "float16" if _GGML_F16 in kinds else "float32"
