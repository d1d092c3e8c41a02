"""A model's files other than its weights, from a Hugging Face model directory or a GGUF
file (torch-free): the router and the engine read the config, the generation config, the
tokenizer, the tokenizer config and the chat template through `open_model`, so a `.gguf`
path serves wherever a directory does.

A directory is read as it always was: `config.json`, `generation_config.json`,
`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` and
`chat_template.jinja`, each by its fixed name inside the directory, nothing else.

A GGUF file has none of them: its metadata (llama.cpp's keys) is turned into what they
would hold. The config as transformers reads a GGUF (`{arch}.*` keys for llama, mistral
and qwen2); the tokenizer as transformers 5 builds it from `tokenizer.ggml.*` (byte-level
BPE for model "gpt2", SentencePiece-style BPE with byte fallback for "llama"). The header
is parsed with `struct` over a memory map, not with the `gguf` package: that needs numpy,
which the router does not load (docs/testing.md#layers), and the metadata is all it needs.

Every refusal is a ValueError naming the file and the reason.
"""

from __future__ import annotations

import json
import mmap
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

__all__ = ["GGUF_ARCHITECTURES", "GGUF_TOKENIZER_MODELS", "DirectoryFiles", "GgufFiles", "GgufHeader",
           "GgufTensor", "ModelFiles", "byte_level_chars", "is_gguf", "open_model"]

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")  # general.architecture values served
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values served

_T = TypeVar("_T")


class ModelFiles(ABC):
    """What a model source (a directory or a GGUF file) says besides its weights."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The config as config.json holds it (model_type, sizes, rope, token ids...)."""

    @abstractmethod
    def generation_config(self) -> dict[str, Any] | None:
        """The generation config (its eos_token_id is where generation stops); None when
        the source has none."""

    @abstractmethod
    def tokenizer_json(self) -> str:
        """The tokenizer as `tokenizers` JSON (tokenizer.json's text)."""

    @abstractmethod
    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json's settings: the special tokens (strings or AddedToken
        dicts), add_bos_token, chat_template...; empty when there are none."""

    @abstractmethod
    def special_tokens_map(self) -> dict[str, Any]:
        """special_tokens_map.json (transformers' legacy file); empty when there is none."""

    @abstractmethod
    def chat_template(self) -> object:
        """The chat template's source as found (a string unless the source is malformed);
        None when there is none."""

    @abstractmethod
    def file_for(self, name: str) -> Path:
        """The file that holds what a model directory's file `name` holds (for messages)."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF model source: a file (not a directory) named *.gguf.
    It says what the source is meant to be; open_model refuses one that is not GGUF."""
    path = Path(path)
    return path.suffix.lower() == ".gguf" and not path.is_dir()


def open_model(path: str | Path) -> ModelFiles:
    """The model source at `path`: a GGUF file (is_gguf) or else a model directory.
    ValueError, naming the file, when a GGUF file cannot be read or is not GGUF."""
    path = Path(path)
    if not is_gguf(path):
        return DirectoryFiles(path)
    try:
        stat = path.stat()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    # The router opens the source once per reader: parse each file version once.
    return _open_gguf(str(path), stat.st_mtime_ns, stat.st_size)


# ---- a Hugging Face model directory ---------------------------------------------------------


class DirectoryFiles(ModelFiles):
    """A Hugging Face model directory, its files read by their fixed names."""

    def config(self) -> dict[str, Any]:
        file = self.path / "config.json"
        if not file.is_file():
            raise ValueError(f"{self.path} is not a model directory: config.json not found")
        return _read_json(file)

    def generation_config(self) -> dict[str, Any] | None:
        file = self.path / "generation_config.json"
        return _read_json(file) if file.is_file() else None

    def tokenizer_json(self) -> str:
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"{self.path} is not a model directory: tokenizer.json not found")
        return _read_text(file)

    def tokenizer_config(self) -> dict[str, Any]:
        return _read_json_or_empty(self.path / "tokenizer_config.json")

    def special_tokens_map(self) -> dict[str, Any]:
        return _read_json_or_empty(self.path / "special_tokens_map.json")

    def chat_template(self) -> object:
        """chat_template.jinja, else tokenizer_config.json's chat_template (of a list of
        named templates, the one named "default")."""
        jinja_file = self.path / "chat_template.jinja"
        if jinja_file.is_file():
            return _read_text(jinja_file)
        source = self.tokenizer_config().get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return source

    def file_for(self, name: str) -> Path:
        return self.path / name


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {file}: it is not UTF-8 text ({exc})") from exc


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object file; ValueError naming the file when it is anything else."""
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a JSON object")
    return raw


def _read_json_or_empty(file: Path) -> dict[str, Any]:
    return _read_json(file) if file.exists() else {}


# ---- a GGUF file: its header --------------------------------------------------------------

_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # the magic, the version, the tensor and metadata counts
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
# metadata value types: struct codes of the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays: the format allows them, no model needs them deep
_DEFAULT_ALIGNMENT = 32  # general.alignment when the file does not set it
_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30  # the ggml types of plain float tensors


class _Truncated(Exception):
    """The file ends inside what is being read."""


class _Cursor:
    """Reads a GGUF header front to back; every read checks that its bytes are there."""

    def __init__(self, data: bytes | mmap.mmap, path: Path, order: str) -> None:
        self.data, self.path, self.order = data, path, order
        self.pos = 8  # past the magic and the version
        self.section = "the header"  # where a refusal says the problem is

    def take(self, fmt: str) -> tuple[Any, ...]:
        try:
            size = struct.calcsize(self.order + fmt)
        except struct.error:  # a count no file could hold (a corrupt or cut-off length)
            raise _Truncated from None
        if self.pos + size > len(self.data):
            raise _Truncated
        values = struct.unpack_from(self.order + fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        if self.pos + length > len(self.data):
            raise _Truncated
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: {self.section} holds a string that is not UTF-8 ({exc})") from None

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: {self.section} has value type {kind}, which GGUF does not define")
        element, count = self.take("IQ")
        if element in _SCALARS:  # one unpack for a whole numeric array (token types, scores)
            return list(self.take(f"{count}{_SCALARS[element]}"))
        if element == _ARRAY and depth >= _MAX_NESTING:
            raise ValueError(f"{self.path}: {self.section} nests arrays deeper than {_MAX_NESTING}")
        return [self.value(element, depth + 1) for _ in range(count)]


@dataclass(frozen=True)
class GgufTensor:
    """One entry of a GGUF file's tensor directory (its data stays in the file)."""

    type_id: int  # ggml type (gguf's GGMLQuantizationType value)
    shape: tuple[int, ...]  # as GGUF lists it: the fastest-varying dimension first
    offset: int  # absolute byte offset of its data in the file


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata (numeric arrays as lists) and tensor directory, by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]

    def get(self, key: str, kind: type[_T]) -> _T | None:
        """Metadata `key` as `kind` (an integer counts as a float); None when absent."""
        value = self.metadata.get(key)
        if value is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{self.path}: the GGUF metadata key {key} must be {_KIND_NAMES[kind]}, "
                             f"got {_shown(value)}")
        return value

    def need(self, key: str, kind: type[_T]) -> _T:
        """Metadata `key` as `kind`; ValueError when the file lacks it."""
        value = self.get(key, kind)
        if value is None:
            raise ValueError(f"{self.path}: the GGUF metadata has no {key}")
        return value

    def items(self, key: str, kind: type[_T]) -> list[_T] | None:
        """An array of `kind`s; None when absent."""
        values = self.get(key, list)
        if values is not None and not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{self.path}: the GGUF metadata key {key} must be an array of "
                             f"{_KIND_NAMES[kind]}s")
        return values


_KIND_NAMES: dict[type, str] = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                                list: "an array"}


def _or(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _shown(value: object) -> str:
    return f"an array of {len(value)}" if isinstance(value, list) else repr(value)


def _read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file `path`, read through a memory map (only its first
    pages are touched). ValueError naming the file when it is not a whole GGUF header."""
    try:
        with path.open("rb") as file:
            _check_start(file.read(_HEADER_BYTES), path)
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(data, path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc


def _check_start(head: bytes, path: Path) -> None:
    if not head:
        raise ValueError(f"{path} is not a GGUF file: it is empty")
    if not _MAGIC.startswith(head[:len(_MAGIC)]):
        raise ValueError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes")
    if len(head) < _HEADER_BYTES:
        raise ValueError(f"{path} is truncated: it holds {len(head)} bytes, less than a GGUF header")


def _parse(data: mmap.mmap, path: Path) -> GgufHeader:
    cursor = _Cursor(data, path, _byte_order(data[4:8], path))
    try:
        tensor_count, kv_count = cursor.take("QQ")
        metadata = _read_metadata(cursor, kv_count)
        tensors = _read_tensor_table(cursor, tensor_count)
    except _Truncated:
        raise ValueError(f"{path} is truncated: it ends ({len(data)} bytes) inside {cursor.section}") from None
    return GgufHeader(path, metadata, _placed(cursor, metadata, tensors))


def _byte_order(version: bytes, path: Path) -> str:
    """'<' or '>': the order the version field reads as a known version in (llama.cpp
    writes big-endian files for big-endian hosts)."""
    for order in "<>":
        if struct.unpack(order + "I", version)[0] in _VERSIONS:
            return order
    (number,) = struct.unpack("<I", version)
    raise ValueError(f"{path} is GGUF version {number}; supported: {', '.join(map(str, _VERSIONS))}")


def _read_metadata(cursor: _Cursor, kv_count: int) -> dict[str, Any]:
    metadata = {}
    for index in range(kv_count):
        cursor.section = f"metadata entry {index} of {kv_count}"
        key = cursor.string()
        cursor.section = f"the metadata value of {key}"
        (kind,) = cursor.take("I")
        metadata[key] = cursor.value(kind)
    return metadata


def _read_tensor_table(cursor: _Cursor, count: int) -> dict[str, GgufTensor]:
    """Each tensor's ggml type, shape and offset in the data section, by name."""
    tensors = {}
    for index in range(count):
        cursor.section = f"the tensor table (tensor {index} of {count})"
        name = cursor.string()
        (dims,) = cursor.take("I")
        shape = cursor.take(f"{dims}Q")
        kind, offset = cursor.take("IQ")
        tensors[name] = GgufTensor(kind, shape, offset)
    return tensors


def _placed(cursor: _Cursor, metadata: dict[str, Any], tensors: dict[str, GgufTensor]) -> dict[str, GgufTensor]:
    """The tensors with absolute offsets: the data section starts at the next alignment
    boundary. A file that ends before a tensor's first byte was cut short (the tensors'
    sizes, which depend on their ggml types, are the weight loader's check)."""
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"{cursor.path}: general.alignment must be a positive integer, got {alignment!r}")
    start = -(-cursor.pos // alignment) * alignment
    placed = {name: replace(t, offset=start + t.offset) for name, t in tensors.items()}
    late = [name for name, t in placed.items() if t.offset >= len(cursor.data)]
    if late:
        raise ValueError(f"{cursor.path} is truncated: it ends ({len(cursor.data)} bytes) before the data "
                         f"of tensor {late[0]}")
    return placed


# ---- a GGUF file: what its metadata stands for --------------------------------------------


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
        return _gguf_tokenizer(self._header, self.tokenizer_config())

    def tokenizer_json(self) -> str:
        return self._tokenizer

    def tokenizer_config(self) -> dict[str, Any]:
        return _gguf_tokenizer_config(self._header)

    def special_tokens_map(self) -> dict[str, Any]:
        return {}

    def chat_template(self) -> object:
        return self._header.get("tokenizer.chat_template", str)

    def file_for(self, name: str) -> Path:
        return self.path


@lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GgufFiles:
    """One parse per version of a file (the arguments after the path key the cache)."""
    return GgufFiles(Path(path), _read_header(Path(path)))


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
        "vocab_size": vocab_size if vocab_size is not None else len(_tokens(header)),
        "hidden_size": need("embedding_length", int),
        "intermediate_size": need("feed_forward_length", int),
        "num_hidden_layers": need("block_count", int),
        "num_attention_heads": heads,
        # absent: one per query head (llama.cpp's default)
        "num_key_value_heads": _or(header.get(f"{arch}.attention.head_count_kv", int), heads),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon", float),
        "rope_theta": _or(header.get(f"{arch}.rope.freq_base", float), 10000.0),
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
                   if (token := header.get(f"tokenizer.ggml.{_ID_KEYS[name]}", int)) is not None})
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


# ---- a GGUF file: its tokenizer -----------------------------------------------------------

# tokenizer_config.json's special tokens and the metadata key of each one's id
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# The pre-tokenizer split of each `tokenizer.ggml.pre` that transformers knows (its
# GGUF_PRE_TOKENIZER_SPLITS); any other byte-level vocabulary splits as GPT-2 does.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet, byte -> character: printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(0x100, 0x200))
    return {byte: chr(byte) if byte in printable else chr(next(shifted)) for byte in range(256)}


def _tokens(header: GgufHeader) -> list[str]:
    tokens = header.items("tokenizer.ggml.tokens", str)
    if not tokens:
        raise ValueError(f"{header.path}: the GGUF metadata has no tokenizer.ggml.tokens")
    return tokens


def _special_token(header: GgufHeader, tokens: list[str], name: str) -> str | None:
    """The text of the `name` token (bos, eos, unk, pad); None when the file names none."""
    key = f"tokenizer.ggml.{_ID_KEYS[name]}"
    token_id = header.get(key, int)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"{header.path}: {key} is {token_id}, outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def _gguf_tokenizer_config(header: GgufHeader) -> dict[str, Any]:
    """tokenizer_config.json as transformers reads this file: the special tokens as text,
    add_bos_token (a SentencePiece vocabulary that does not say adds BOS, as llama.cpp
    does), add_eos_token and the chat template."""
    config: dict[str, Any] = {}
    if any(header.get(f"tokenizer.ggml.{key}", int) is not None for key in _ID_KEYS.values()):
        tokens = _tokens(header)
        named = {f"{name}_token": _special_token(header, tokens, name) for name in _ID_KEYS}
        config.update({name: token for name, token in named.items() if token is not None})
    default_bos = header.get("tokenizer.ggml.model", str) == "llama"
    config["add_bos_token"] = _or(header.get("tokenizer.ggml.add_bos_token", bool), default_bos)
    config["add_eos_token"] = _or(header.get("tokenizer.ggml.add_eos_token", bool), False)
    template = header.get("tokenizer.chat_template", str)
    if template is not None:
        config["chat_template"] = template
    return config


def _gguf_tokenizer(header: GgufHeader, config: dict[str, Any]) -> str:
    """tokenizer.json for this file, as transformers 5 builds it (its GGUF tokenizer
    mapping): the model's BPE, its control tokens as special added tokens and its
    user-defined ones as plain added tokens, BOS/EOS added as add_bos/eos_token say."""
    model = header.get("tokenizer.ggml.model", str)
    if model not in GGUF_TOKENIZER_MODELS:
        raise ValueError(f"{header.path}: unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                         f"supported: {', '.join(GGUF_TOKENIZER_MODELS)}")
    tokens = _tokens(header)
    tokenizer = _byte_level_bpe(header, tokens) if model == "gpt2" else _sentencepiece_bpe(header, tokens)
    _add_tokens(tokenizer, header, tokens, config)
    tokenizer.post_processor = _post_processor(tokenizer, config)
    return tokenizer.to_str()


def _byte_level_bpe(header: GgufHeader, tokens: list[str]) -> Tokenizer:
    """GPT-2's byte-level BPE; a token spelled outside the byte alphabet is respelled
    in it, byte by byte (as transformers does)."""
    spelling = byte_level_chars()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
             for index, token in enumerate(tokens)}
    merges = header.items("tokenizer.ggml.merges", str)
    if merges is None:
        raise ValueError(f"{header.path}: the GGUF metadata has no tokenizer.ggml.merges (a byte-level "
                         "BPE vocabulary needs them)")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(header, merges), dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = _PRE_SPLITS.get(header.get("tokenizer.ggml.pre", str) or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(header: GgufHeader, tokens: list[str]) -> Tokenizer:
    """SentencePiece as BPE with byte fallback (transformers' LlamaTokenizer): "▁" for
    spaces, one prepended to the text unless tokenizer.ggml.add_space_prefix is false;
    the merges the file lists, else the ones its scores imply."""
    vocab = {token: index for index, token in enumerate(tokens)}
    listed = header.items("tokenizer.ggml.merges", str)
    merges = _merge_pairs(header, listed) if listed is not None else _merges_by_score(header, tokens, vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = _or(header.get("tokenizer.ggml.add_space_prefix", bool), True)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] * prefix)
    return tokenizer


def _merge_pairs(header: GgufHeader, merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(merge.split(" ")) for merge in merges]
    bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"{header.path}: tokenizer.ggml.merges entry {bad} ({merges[bad]!r}) is not two "
                         "tokens separated by one space")
    return [(left, right) for left, right in pairs]


def _merges_by_score(header: GgufHeader, tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a scored vocabulary implies (transformers' generate_merges): every split
    of a token into two tokens, ordered by the token's score, best first (ties: the
    longer left piece, then the longer right one; then the vocabulary's order)."""
    scores = header.items("tokenizer.ggml.scores", float)
    if scores is None:
        raise ValueError(f"{header.path}: the GGUF metadata has neither tokenizer.ggml.merges nor "
                         "tokenizer.ggml.scores, so the vocabulary has no merge order")
    found: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores)).items():
        splits = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        found += sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_tokens(tokenizer: Tokenizer, header: GgufHeader, tokens: list[str], config: dict[str, Any]) -> None:
    """Control tokens and the named special ones as special added tokens (matched whole,
    never split); user-defined ones (<think>) as plain added tokens. In a byte-level
    vocabulary a control token outside the byte alphabet is a llama.cpp mislabel, left
    out (as transformers does): adding it would grow the vocabulary."""
    types = header.items("tokenizer.ggml.token_type", int) or []
    vocab = tokenizer.get_vocab()
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and t in vocab]
    named = [config[f"{name}_token"] for name in _ID_KEYS if config.get(f"{name}_token") in vocab]
    special = list(dict.fromkeys(control + named))
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab and t not in special]
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(tokenizer: Tokenizer, config: dict[str, Any]) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence where add_bos/eos_token say (transformers'
    update_post_processor)."""
    ids = tokenizer.get_vocab()
    bos, eos = (config.get(f"{name}_token") if config[f"add_{name}_token"] else None for name in ("bos", "eos"))
    bos, eos = (token if token in ids else None for token in (bos, eos))
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special = [(token, ids[token]) for token in dict.fromkeys((bos, eos)) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
