"""A connector whose store calls failed: what its own stats and logs showed in a run that loaded nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..driver import StepRecord
from .diagnosis import Diagnosis

__all__ = ["WarningLog", "capture_warnings", "store_trouble"]


class WarningLog(logging.Handler):
    """Collects what a connector logs at WARNING or above while a run plays (:func:`capture_warnings`)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger().addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] != "kvconn":  # the connector's own loggers, not the SDK's
            self.messages.append(f"{record.name}: {record.getMessage()}")

    def close(self) -> None:
        logging.getLogger().removeHandler(self)
        super().close()


def capture_warnings() -> WarningLog:
    """Start collecting warnings (a connector logging its store errors); ``close()`` stops."""
    return WarningLog()


#: Words in a connector's own stats keys that count failures (``store_errors``, ``put_failures``).
_FAILURE_WORDS = ("error", "fail", "timeout", "refused", "unreachable")


def store_trouble(records: Sequence[StepRecord], degraded_events: int, warnings: Sequence[str]) -> Diagnosis | None:
    """What the connector's own stats and logs showed in a run that loaded nothing: store calls failing.

    Reads ``degraded_events`` (work it dropped itself) and any stats key
    counting failures, summed over the run, and the first warning it
    logged. ``None`` when nothing shows a failing store.
    """
    failures: dict[str, float] = {}
    for record in records:
        out = record.connector_output
        for key, value in (out.stats if out is not None else {}).items():
            if any(word in key.lower() for word in _FAILURE_WORDS) and not key.startswith("_"):
                failures[key] = failures.get(key, 0) + value
    shown = {k: v for k, v in failures.items() if v}
    if degraded_events:
        shown = {"degraded_events": degraded_events, **shown}
    if not shown and not warnings:
        return None
    counted = f"its own stats count {', '.join(f'{k}={v:g}' for k, v in shown.items())}" if shown else ""
    more = f" (and {len(warnings) - 1} more)" if len(warnings) > 1 else ""
    logged = f"it logged {warnings[0]!r}{more}" if warnings else ""
    evidence = "; ".join(part for part in (counted, logged) if part)
    return Diagnosis(
        f"{evidence}: its store calls failed (is the store reachable?)",
        "make the store reachable: start its server, or point the connector's config at one that is running "
        "(kvconn validate --config '{...}'); the connector degraded every store call to no save and no hit, "
        "as it should, so nothing was there to load",
    )
