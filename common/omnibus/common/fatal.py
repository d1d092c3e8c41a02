"""Leaving on purpose: when a process can no longer do its job (a stalled or dead step
loop, a background task the router cannot work without), it exits with EXIT_CODE so the
orchestrator (compose's restart policy, Kubernetes) starts a fresh one, rather than stay
up reporting SERVING."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import structlog

log = structlog.get_logger("omnibus.fatal")

EXIT_CODE = 70  # EX_SOFTWARE: the orchestrator restarts the process

_T = TypeVar("_T")


def exit_process(message: str) -> None:
    """Leaves now, without a clean shutdown (which could wait on what is broken)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(EXIT_CODE)


def exit_if_it_fails(task: asyncio.Task[_T], exit: Callable[[str], None] | None = None
                     ) -> asyncio.Task[_T]:
    """`task`, a background task the process cannot work without: if it ever ends with an
    exception (a bug), the process logs it and exits (`exit`, by default `exit_process`).
    Cancelling it is not a failure."""

    def done(t: asyncio.Task[_T]) -> None:
        if t.cancelled() or t.exception() is None:
            return
        exc = t.exception()
        message = f"background task {t.get_name()!r} failed ({exc!r}); exiting so the process is restarted"
        log.critical("background_task_failed", task=t.get_name(), exit_code=EXIT_CODE, message=message,
                     exc_info=exc)
        (exit or exit_process)(message)

    task.add_done_callback(done)
    return task
