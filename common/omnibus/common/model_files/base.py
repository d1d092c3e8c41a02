"""What a model source (a Hugging Face directory or a GGUF file) says besides its weights."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any


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
