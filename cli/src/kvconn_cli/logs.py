"""Logging for commands that run connectors: one line per record, tracebacks only with ``--debug``.

The host and engine log degraded connector calls with their exceptions; a
user should see that one line, not a traceback, unless they asked for it.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["configure_logging", "debug_from_env"]


def debug_from_env() -> bool:
    """``KVCONN_DEBUG`` is set (and not ``0``): every command behaves as with ``--debug``."""
    return os.environ.get("KVCONN_DEBUG", "") not in ("", "0")


class _OneLineFormatter(logging.Formatter):
    """Drops exception and stack text: the message alone."""

    def formatException(self, ei: object) -> str:
        return ""

    def formatStack(self, stack_info: str) -> str:
        return ""


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time: under a live progress bar rich swaps it
    for a proxy that prints above the bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def configure_logging(debug: bool) -> None:
    """Log to stderr: WARNING and up in one line each, or everything with tracebacks under ``debug``."""
    handler = _StderrHandler()
    fmt = "kvconn: %(levelname)s %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if debug else _OneLineFormatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
