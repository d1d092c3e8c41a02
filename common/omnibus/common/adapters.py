"""What a LoRA adapter may be called. Torch-free, so the router (which has no torch)
validates the x-adapter-id header with the very rule the engine uses."""

from __future__ import annotations

import re

# 1-128 ASCII letters, digits, '.', '_', '-', starting with a letter or digit: no path
# separators, no "..", no hidden files, no unicode look-alikes. Match with fullmatch.
ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def is_adapter_name(name: object) -> bool:
    return isinstance(name, str) and ADAPTER_NAME_RE.fullmatch(name) is not None


def adapter_name_error(name: object, where: str = "") -> str | None:
    """None for a well-formed adapter name, else the message that says why (`where`, e.g.
    " in x-adapter-id", says where the name came from)."""
    if is_adapter_name(name):
        return None
    shown = name[:40] + "..." if isinstance(name, str) and len(name) > 40 else name
    return (
        f"invalid adapter name {shown!r}{where}: use 1-128 ASCII letters, digits, '.', '_' "
        "or '-', starting with a letter or digit"
    )
