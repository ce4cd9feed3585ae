"""Where output goes: data on stdout, everything for people (progress, errors) on stderr.

With ``--json`` stdout carries the JSON document and nothing else, so it can
be piped into ``jq``. rich is imported on first use: ``kvconn --help`` and the
JSON paths do not pay for it.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["err_console", "error", "out_console", "print_json", "print_traceback", "warn"]


@functools.cache
def out_console() -> Console:
    """The rich console on stdout (tables)."""
    from rich.console import Console

    return Console(highlight=False)


@functools.cache
def err_console() -> Console:
    """The rich console on stderr (progress, notes)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def print_json(document: Any) -> None:
    """Write ``document`` as indented JSON to stdout, bypassing rich (no wrapping, no markup)."""
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    sys.stdout.flush()


def error(message: str) -> None:
    """One line on stderr: ``kvconn: error: <message>``."""
    sys.stderr.write(f"kvconn: error: {message}\n")


def warn(message: str) -> None:
    """One line on stderr: ``kvconn: warning: <message>``."""
    sys.stderr.write(f"kvconn: warning: {message}\n")


def print_traceback(exc: BaseException) -> None:
    """The full traceback of ``exc`` (with its causes) on stderr; for ``--debug``."""
    sys.stderr.write("".join(traceback.format_exception(exc)))
