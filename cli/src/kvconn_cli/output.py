"""Where output goes: data on stdout, everything for people (progress, errors) on stderr.

With ``--json`` stdout carries the JSON document and nothing else, so it can
be piped into ``jq``; every document carries :data:`SCHEMA_VERSION`. Text is
printed as given: no emoji codes (``nomod:X:`` stays as it is). When stdout is
not a terminal, tables are plain columns that are never wrapped (like ``pip
list``), so they can be read by ``grep``, ``awk`` and people alike. rich is
imported on first use: ``kvconn --help`` and the JSON paths do not pay for it.
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "SCHEMA_VERSION",
    "err_console",
    "error",
    "note",
    "out_console",
    "print_json",
    "print_table",
    "print_traceback",
    "warn",
]

#: The version of every ``--json`` document's layout (its ``schema_version`` field); bumped on a breaking change.
SCHEMA_VERSION = 1

#: Width of stdout when it is not a terminal: wide enough that no table or line is ever wrapped.
_UNWRAPPED_WIDTH = 100_000


@functools.cache
def out_console() -> Console:
    """The rich console on stdout (tables); not wrapped when stdout is not a terminal."""
    from rich.console import Console

    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(highlight=False, emoji=False, width=_UNWRAPPED_WIDTH)
    return console


@functools.cache
def err_console() -> Console:
    """The rich console on stderr (progress, notes)."""
    from rich.console import Console

    return Console(stderr=True, highlight=False, emoji=False)


def print_table(table: Table) -> None:
    """``table`` on stdout: boxed on a terminal; otherwise plain columns, one line per row, never wrapped."""
    console = out_console()
    if console.is_terminal:
        console.print(table)
        return
    from rich.text import Text

    def plain(cell: object) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return " ".join(text.split())

    header = [plain(c.header) for c in table.columns]
    rows = [[plain(cell) for cell in cells] for cells in zip(*(c._cells for c in table.columns), strict=True)]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *rows]
    if table.title:
        sys.stdout.write(plain(table.title) + "\n")
    for line in lines:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() + "\n")
    sys.stdout.flush()


def print_json(document: dict[str, Any]) -> None:
    """Write ``document`` with its ``schema_version`` as indented JSON to stdout, bypassing rich."""
    sys.stdout.write(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2) + "\n")
    sys.stdout.flush()


def note(message: str) -> None:
    """One line for people on stderr (``plot written to ...``): never mixed into stdout's data."""
    sys.stderr.write(f"{message}\n")


def error(message: str) -> None:
    """One line on stderr: ``kvconn: error: <message>``."""
    sys.stderr.write(f"kvconn: error: {message}\n")


def warn(message: str) -> None:
    """One line on stderr: ``kvconn: warning: <message>``."""
    sys.stderr.write(f"kvconn: warning: {message}\n")


def print_traceback(exc: BaseException) -> None:
    """The full traceback of ``exc`` (with its causes) on stderr; for ``--debug``."""
    sys.stderr.write("".join(traceback.format_exception(exc)))
