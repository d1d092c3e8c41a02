"""Chat messages → prompt text, by the model's own chat template.

The template is the Hugging Face one: `chat_template.jinja` in the model directory, or
`chat_template` in its `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used); a GGUF file's `tokenizer.chat_template` (read by
omnibus.common.model_files, as every model file). It is rendered as transformers renders it (trim_blocks,
lstrip_blocks, loop controls, the `{% generation %}` block, `raise_exception`, `tojson`,
`strftime_now`, `add_generation_prompt`, `tools` (None without), `documents` as None,
the special tokens by name), in Jinja's immutable sandbox: a template cannot call
methods that change objects or reach Python internals.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omnibus.common.model_files import ModelFiles, open_model
from omnibus.router.service.errors import invalid

# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Refusal(jinja2.TemplateError):
    """The template's own raise_exception(message)."""


def _raise_exception(message: str) -> None:
    raise _Refusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens
    with it (for training masks); rendering a prompt, the block is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class ChatTemplate:
    """A compiled chat template and the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        """Raises ValueError when `source` is not a valid Jinja template."""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from exc
        self._special_tokens = special_tokens

    @classmethod
    def load(cls, model: str | Path) -> ChatTemplate | None:
        """The chat template of the model directory or GGUF file `model`, or None when it
        has none. Raises ValueError when the tokenizer config or the template cannot be
        read or compiled."""
        files = open_model(model)
        source = files.chat_template()
        if source is None:
            return None
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{model}: the chat template must be a non-empty string")
        return cls(source, _special_tokens(files))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt for `messages` (dicts with role and text content, and an assistant's
        tool_calls) and `tools` (OpenAI's {"type": "function", "function": {...}} objects,
        as transformers' apply_chat_template passes dicts). Raises
        RequestError(INVALID_ARGUMENT) when the template refuses them or fails on them."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,  # None is defined, as transformers defines it: `tools is not none` is false
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except _Refusal as exc:
            raise invalid(f"the model's chat template refused the messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (whatever the template raises on these messages:
            # a TemplateError, ZeroDivisionError, the sandbox's OverflowError, RecursionError...)
            raise invalid(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None


def tokenizer_info(model: str | Path) -> dict[str, Any]:
    """What vLLM's GET /tokenizer_info shows (clients such as lm-evaluation-harness read
    the special tokens and the chat template from it): tokenizer_config.json's settings
    without its added-token table, the special tokens as text, the chat template (None
    when there is none). Raises ValueError when the config cannot be read."""
    files = open_model(model)
    source = files.chat_template()
    info = {k: v for k, v in files.tokenizer_config().items() if k not in ("added_tokens_decoder", "auto_map")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    return {**info, **_special_tokens(files), "chat_template": source if isinstance(source, str) else None}


def _special_tokens(files: ModelFiles) -> dict[str, str]:
    """The special tokens a template sees, by name, as transformers sets them: the named
    ones of tokenizer_config.json (and the model-specific ones of its extra_special_tokens
    dict), overridden by special_tokens_map.json where the config has no
    added_tokens_decoder (transformers' legacy files). An unset token stays undefined."""
    config = files.tokenizer_config()
    values = dict(config)
    if "added_tokens_decoder" not in config:
        values.update(files.special_tokens_map())
    names = list(_SPECIAL_TOKENS)
    extra = values.get("extra_special_tokens")
    if isinstance(extra, dict):
        names += extra
        values = {**values, **extra}
    return {name: _token_text(values[name]) for name in names if values.get(name) is not None}


def _token_text(token: object) -> str:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""
