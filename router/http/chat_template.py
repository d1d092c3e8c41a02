"""Chat messages → prompt text, by the model's own chat template.

The template is the Hugging Face one: `chat_template.jinja` in the model directory, or
`chat_template` in its `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used). It is rendered as transformers renders it (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `tojson`, `strftime_now`,
`add_generation_prompt`, the special tokens by name), in Jinja's immutable sandbox: a
template cannot call methods that change objects or reach Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omnibus.router.service.errors import invalid

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _Refusal(jinja2.TemplateError):
    """The template's own raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _Refusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        """Raises ValueError when `source` is not a valid Jinja template."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from exc
        self._special_tokens = special_tokens

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's chat template, or None when it has none. Raises ValueError when the
        tokenizer config or the template cannot be read or compiled."""
        model_dir = Path(model_dir)
        config = _read_config(model_dir / "tokenizer_config.json")
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            source: object = jinja_file.read_text()
        else:
            source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{model_dir}: the chat template must be a non-empty string")
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_TOKENS}
        return cls(source, special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts with role and text content). Raises
        RequestError(INVALID_ARGUMENT) when the template refuses them or fails on them."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except _Refusal as exc:
            raise invalid(f"the model's chat template refused the messages: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise invalid(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
