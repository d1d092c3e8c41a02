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

from pathlib import Path

from omnibus.common.model_files.base import ModelFiles
from omnibus.common.model_files.directory import DirectoryFiles
from omnibus.common.model_files.gguf import GGUF_ARCHITECTURES, GgufFiles, open_gguf
from omnibus.common.model_files.gguf_header import GgufHeader, GgufTensor
from omnibus.common.model_files.gguf_tokenizer import GGUF_TOKENIZER_MODELS, byte_level_chars

__all__ = ["GGUF_ARCHITECTURES", "GGUF_TOKENIZER_MODELS", "DirectoryFiles", "GgufFiles", "GgufHeader",
           "GgufTensor", "ModelFiles", "byte_level_chars", "is_gguf", "open_model"]


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
    return open_gguf(str(path), stat.st_mtime_ns, stat.st_size)
