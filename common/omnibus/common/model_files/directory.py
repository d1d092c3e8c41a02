"""A Hugging Face model directory, its files read by their fixed names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnibus.common.model_files.base import ModelFiles


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
