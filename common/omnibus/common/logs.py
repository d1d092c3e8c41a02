"""structlog set up to write one JSON object per line to stderr."""

from __future__ import annotations

import atexit
import logging
import os
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    """JSON lines with a timestamp, level and the event's key-value pairs."""
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries that log through the standard library (aiohttp, grpc) write JSON lines too,
    # with their logger's name and any traceback inside the line.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    ))
    handler.omnibus = True  # type: ignore[attr-defined]  # ours: replaced when called again
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "omnibus", False)] + [handler]
    root.setLevel(numeric)


def quiet_shutdown() -> None:
    """From interpreter shutdown on, stderr goes to /dev/null: triton's nanobind bindings
    print a multi-line leak report (no final newline) while the interpreter tears down,
    which breaks the JSON lines and the last one with them. Triton silences its own
    compile workers the same way. Registered by the engine's processes once logging is
    configured; everything they log before exiting is written by then."""

    def silence() -> None:
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    atexit.register(silence)
