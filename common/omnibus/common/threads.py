"""Native names for the threads that matter, so `top -H`, `ps -L`, py-spy and
/proc/<pid>/task/*/comm tell them apart (Python does not name native threads)."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

_PR_SET_NAME = 15  # prctl(2)


@functools.cache
def _prctl() -> Callable[..., int]:
    """libc's prctl, from the symbols already loaded into this process (no library
    search, which would run a subprocess)."""
    return ctypes.CDLL(None, use_errno=True).prctl


def name_this_thread(name: str) -> None:
    """Sets the calling thread's native name; Linux keeps its first 15 bytes. Elsewhere
    nothing happens."""
    if sys.platform.startswith("linux"):
        _prctl()(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
