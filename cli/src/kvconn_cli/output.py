"""Where output goes: data on stdout, everything for people (progress, errors) on stderr.

With ``--json`` stdout carries the JSON document and nothing else, so it can
be piped into ``jq``; every document carries :data:`SCHEMA_VERSION`. Text is
printed as given: no emoji codes (``nomod:X:`` stays as it is). When stdout is
not a terminal, tables are plain columns that are never wrapped (like ``pip
list``), so they can be read by ``grep``, ``awk`` and people alike. rich is
imported on first use: ``kvconn --help`` and the JSON paths do not pay for it.

stdout is kept for the data below Python too (:func:`reserve_stdout`, around
every command of the ``kvconn`` executable): file descriptor 1 is pointed at
stderr, so bytes a plugin writes there (``os.write(1, ...)``, a C extension's
``printf``) land on stderr, and ``sys.stdout`` writes to a private copy of the
real stdout.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
import traceback
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "SCHEMA_VERSION",
    "child_stdout",
    "err_console",
    "error",
    "note",
    "out_console",
    "print_json",
    "print_table",
    "print_traceback",
    "reserve_stdout",
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


@contextlib.contextmanager
def reserve_stdout() -> Iterator[None]:
    """Keep the process's stdout for the command's data, at the file-descriptor level.

    While it runs, descriptor 1 is a copy of stderr, and ``sys.stdout`` (when
    it is the process's stdout, not a test's capture) writes to a private
    descriptor holding the real stdout; children started with ``stdout=sys.stdout``
    get the real one. On the way out C stdio's buffers are flushed (a
    ``printf`` still buffered lands on stderr, not after the data) and
    descriptor 1 is restored. Python-level ``print`` from plugins is redirected
    separately, around the calls into them.
    """
    original = sys.stdout
    try:
        original.flush()
        writes_fd_1 = original.fileno() == 1
    except (AttributeError, OSError, ValueError):  # no stdout, or a stream without a descriptor
        writes_fd_1 = False
    try:
        saved = os.dup(1)
    except OSError:  # descriptor 1 is closed: nothing of ours or theirs reaches a stdout
        yield
        return
    os.dup2(2, 1)
    data = None
    if writes_fd_1:
        data = io.TextIOWrapper(
            io.FileIO(saved, "w", closefd=False),
            encoding=original.encoding,
            errors=original.errors,
            line_buffering=bool(original.line_buffering),
        )
        sys.stdout = data
    try:
        yield
    finally:
        for stream in (data, original, sys.__stdout__):
            if stream is not None:
                stream.flush()  # Python's buffers: the data to the real stdout, anything else to stderr
        _flush_c_stdio()
        os.dup2(saved, 1)
        if data is not None:
            data.close()  # the wrapper only: the descriptor is closed next
        os.close(saved)
        sys.stdout = original


def child_stdout() -> int | None:
    """The ``stdout=`` for a child process whose output is the command's data: the real stdout's descriptor.

    Under :func:`reserve_stdout` descriptor 1 is stderr, so a child must be
    given this one; ``None`` (inherit) where ``sys.stdout`` has no descriptor.
    """
    sys.stdout.flush()
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: what C code printed into its stdio buffers goes out now, while fd 1 is stderr."""
    import ctypes

    # No C library to reach (not a POSIX system): then nothing is buffered there either.
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).fflush(None)
