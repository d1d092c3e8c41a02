"""What the command-line tools share: help that states each default once, and the
argument types their flags need."""

from __future__ import annotations

import argparse
import math
import re


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)", except where the help states its default itself, where
    there is none to state (None, a switch), so no flag reads as its opposite
    (`--no-prefix-caching ... (default: True)`)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or "unset" in text or action.default is None
                or isinstance(action.default, bool)):
            return text
        return super()._get_help_string(action)


def positive(text: str, unit: str = "") -> float:
    """A positive, finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number{unit}: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number{unit}, got {text}")
    return value


MAX_SECONDS = 1e8  # about 3.2 years


def seconds(text: str) -> float:
    """A positive, finite number of seconds, at most MAX_SECONDS (1e8, about 3 years).

    A deadline of inf or NaN would have expired; so does a finite one past what gRPC can
    carry: grpc (1.85) turns now + timeout into int64 nanoseconds since the epoch, which
    overflows (an instant DEADLINE_EXCEEDED) from about 7e9 seconds on."""
    value = positive(text, " of seconds")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_SECONDS:g} seconds (about 3 years), got {text}"
        )
    return value


def _integer(text: str, lo: int, hi: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def int32(text: str) -> int:
    """An integer that fits a protobuf int32 field."""
    return _integer(text, -(2**31), 2**31 - 1, "a 32-bit integer")


def uint64(text: str) -> int:
    """An integer that fits a protobuf uint64 field (a seed)."""
    return _integer(text, 0, 2**64 - 1, "in [0, 2**64 - 1]")


def count(text: str) -> int:
    """A whole number >= 1 (that fits an int32 field)."""
    return _integer(text, 1, 2**31 - 1, "a whole number >= 1")


def config_error(exc: ValueError, parser: argparse.ArgumentParser) -> str:
    """A config's "<field> must be ..." as the flags that set them say it: the field, and
    any other field the message names (snake_case words), as "--field" when `parser` (or
    one of its subcommands) has that flag, or has exactly one flag ending in "-field"
    (--tenant-max-concurrent for max_concurrent); else as it was."""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += action.choices.values()
    flags = {flag for p in parsers for flag in p._option_string_actions if flag.startswith("--")}

    def as_flag(field: str) -> str | None:
        name = field.replace("_", "-")
        if f"--{name}" in flags:
            return f"--{name}"
        ending = [f for f in flags if f.endswith(f"-{name}")]
        return ending[0] if len(ending) == 1 else None

    field, _, rest = str(exc).partition(" ")
    flag = as_flag(field) if rest.startswith("must ") else None
    if flag is None:
        return str(exc)
    rest = re.sub(r"\b[a-z]+(?:_[a-z0-9]+)+\b", lambda m: as_flag(m.group()) or m.group(), rest)
    return f"{flag} {rest}"
