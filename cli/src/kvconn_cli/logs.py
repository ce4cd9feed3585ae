"""Logging for commands that run connectors: one line per record, tracebacks only with ``--debug``.

The host and engine log degraded connector calls with their exceptions; a
user should see that one line, not a traceback, unless they asked for it.
A run that builds many engines (``kvconn validate``: one per scenario, more
under ``--engine vllm``) logs the same warning once per engine, and vLLM and
torch add their start-up chatter each time; :class:`WarningSummary` keeps the
report readable: each distinct warning once, with a count, after the report,
and the engines' own warnings only counted unless ``-v`` asks for them.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvconn.testing.conformance import CheckResult

__all__ = ["WarningSummary", "configure_logging", "debug_from_env"]

#: Loggers whose records below ERROR are the engines' own chatter (vLLM's "this API is experimental" once per
#: engine built, its import notes): counted, shown with ``-v``.
ENGINE_LOGGERS = ("vllm", "torch")


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


_FORMAT = "kvconn: %(levelname)s %(name)s: %(message)s"
#: What two logs of one warning may differ in (a count of tokens, a request's number).
_NUMBER = re.compile(r"\d+(\.\d+)?")


def configure_logging(debug: bool, *, verbose: bool = False) -> None:
    """Log to stderr: WARNING and up in one line each, INFO too with ``verbose``, or everything with
    tracebacks under ``debug``."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(_FORMAT) if debug else _OneLineFormatter(_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING)


class WarningSummary(logging.Handler):
    """Collects the records of a run in place of the stderr handler; :meth:`report` writes each distinct one once.

    Records are the same warning when they come from one logger with one message but for its numbers ("64
    tokens" and "16 tokens" are one, shown as first logged; another connector's name makes another). Each
    says the checks it was logged under (:meth:`attributing`): some checks inject faults, and a warning a
    green run shows is then theirs ("a block was gone when loaded" while KV041 makes a store lose blocks).
    The engines' own records below ERROR (:data:`ENGINE_LOGGERS`) are only counted. Torch, which logs
    through a handler of its own, is told to keep its warnings (``TORCH_LOGS=-torch``) unless the
    environment says otherwise.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_OneLineFormatter(_FORMAT))
        self.counts: collections.Counter[tuple[str, int, str]] = collections.Counter()
        self.first: dict[tuple[str, int, str], str] = {}
        self.hidden = 0
        #: Per warning, the checks that logged it; and the warnings logged since the last check ended.
        self.checks: dict[tuple[str, int, str], dict[str, None]] = collections.defaultdict(dict)
        self._pending: list[tuple[str, int, str]] = []
        self._replaced: list[logging.Handler] = []
        from kvconn.testing.conformance.request_ids import untag_any  # the suite's, as the report's messages

        #: request ids as the scenarios name them ('b1', not the engine's 'b1-3f9c1e.4')
        self._untag = untag_any

    def install(self) -> WarningSummary:
        """Take the root logger's place of its handlers until :meth:`report`."""
        root = logging.getLogger()
        self._replaced, root.handlers[:] = root.handlers[:], [self]
        os.environ.setdefault("TORCH_LOGS", "-torch")  # read when torch is imported, by this process and children
        return self

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR and record.name.partition(".")[0] in ENGINE_LOGGERS:
            self.hidden += 1
            return
        key = (record.name, record.levelno, _NUMBER.sub("#", self._untag(record.getMessage())))
        if key not in self.first:
            self.first[key] = self._untag(self.format(record))
        self.counts[key] += 1
        self._pending.append(key)

    def attributing(self, on_result: Callable[[CheckResult], None]) -> Callable[[CheckResult], None]:
        """``on_result``, which first marks the warnings logged since the previous result as this check's."""

        def attribute(result: CheckResult) -> None:
            for key in self._pending:
                self.checks[key][result.id] = None
            self._pending.clear()
            on_result(result)

        return attribute

    def report(self) -> None:
        """Give the root logger its handlers back, then write each distinct record once, with its count."""
        logging.getLogger().handlers[:] = self._replaced
        lines = [
            self.first[key] + _count_and_checks(n, list(self.checks.get(key, ()))) for key, n in self.counts.items()
        ]
        if self.hidden:
            lines.append(f"kvconn: {self.hidden} log lines of the engines (vLLM, torch) not shown: -v shows them")
        sys.stderr.write("".join(f"{line}\n" for line in lines))


def _count_and_checks(count: int, checks: list[str]) -> str:
    """`` (3 times, while KV041 ran)``: how often a warning came, and under which checks; empty for once, outside."""
    said = [f"{count} times"] if count > 1 else []
    if checks:
        said.append(f"while {', '.join(checks)} ran")
    return f" ({', '.join(said)})" if said else ""
