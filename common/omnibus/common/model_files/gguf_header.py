"""A GGUF file's header (metadata and tensor directory), parsed with `struct` over a
memory map."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # the magic, the version, the tensor and metadata counts
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
# metadata value types: struct codes of the fixed-size ones; 8 is a string, 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 4  # arrays of arrays: the format allows them, no model needs them deep
_DEFAULT_ALIGNMENT = 32  # general.alignment when the file does not set it


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


def or_default(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _shown(value: object) -> str:
    return f"an array of {len(value)}" if isinstance(value, list) else repr(value)


def read_header(path: Path) -> GgufHeader:
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
