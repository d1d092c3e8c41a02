"""A checkpoint's context length, read from its config.json as transformers reads it
(torch-free): the router advertises and checks the context the engines serve.

transformers' per-architecture defaults apply to keys config.json leaves out
(LlamaConfig, MistralConfig, Qwen2Config in transformers 5). Every refusal is a
ValueError saying what is wrong.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

__all__ = ["SUPPORTED_ARCHITECTURES", "architecture", "context_length", "field", "max_positions",
           "sliding_window"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_DEFAULT_WINDOW = 4096  # MistralConfig's and Qwen2Config's sliding_window
_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config: layers from this index on slide


_MISSING = object()
_Kind = TypeVar("_Kind", int, float, bool)
_Default = TypeVar("_Default")


@overload
def field(raw: dict[str, Any], key: str, kind: type[_Kind]) -> _Kind: ...


@overload
def field(raw: dict[str, Any], key: str, kind: type[_Kind], default: _Default
          ) -> _Kind | _Default: ...


def field(raw: dict[str, Any], key: str, kind: type, default: object = _MISSING) -> object:
    """config.json's `key` as `kind` (int, float or bool), refused when JSON holds another
    type (as transformers' typed configs refuse it) rather than coerced: bool("false") is
    True and int(2.7) is 2. An integral float counts as an int. A missing key or null
    gives `default`; without one, KeyError when missing, ValueError when null."""
    value = raw.get(key)
    if value is None and default is not _MISSING:
        return default
    if key not in raw:
        raise KeyError(key)
    if kind is bool:
        ok = isinstance(value, bool)
    elif isinstance(value, bool):
        ok = False
    elif kind is int:
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    else:
        ok = isinstance(value, (int, float))
    if not ok:
        what = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise ValueError(f"config.json's {key} must be {what}, got {value!r}")
    return kind(value)


def architecture(raw: dict[str, Any]) -> str:
    """config.json's model_type, if Omnibus serves it."""
    kind: str | None = raw.get("model_type")
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if not kind:
        raise ValueError(f"config.json has no model_type; supported: {supported}")
    if kind not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {kind!r}; supported: {supported}")
    return kind


def max_positions(raw: dict[str, Any]) -> int:
    """max_position_embeddings, or the architecture's default when config.json has none."""
    return field(raw, "max_position_embeddings", int, _DEFAULT_MAX_POSITIONS[architecture(raw)])


def sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window of the layers that slide; None when every layer attends to
    the whole context. Llama has none. Mistral applies `sliding_window` (default 4096;
    null: none) to every layer and has no `use_sliding_window` switch. Qwen2 slides only
    with `use_sliding_window`, on the layers `layer_types` marks "sliding_attention"
    (by default those from `max_window_layers` on)."""
    kind = architecture(raw)
    if kind == "llama":
        return None
    if kind == "qwen2":
        if not field(raw, "use_sliding_window", bool, False):
            return None  # transformers sets sliding_window to None: no layer slides
        layers = raw.get("layer_types")
        if layers is not None:
            slides = "sliding_attention" in layers
        else:
            first = field(raw, "max_window_layers", int, _DEFAULT_MAX_WINDOW_LAYERS)
            slides = first < field(raw, "num_hidden_layers", int)
        if not slides:
            return None
    if "sliding_window" in raw and raw["sliding_window"] is None:
        return None
    window = field(raw, "sliding_window", int, _DEFAULT_WINDOW)
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens or null, got {window}")
    return window


def context_length(raw: dict[str, Any]) -> int:
    """Most tokens (prompt + output) one sequence may hold. Sliding-window attention is
    not implemented, so the window caps the context: within it, sliding-window and full
    attention are the same computation."""
    length = max_positions(raw)
    window = sliding_window(raw)
    return length if window is None else min(length, window)
