"""A connector whose store calls failed: what its own stats and logs showed in a run that loaded nothing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..driver import StepRecord
from .diagnosis import Diagnosis

__all__ = ["WarningLog", "capture_warnings", "lost_saves", "store_refusals", "store_trouble"]


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


#: What the store layer (``kvconn.store``) counts when it refuses a loaded value, as a store author reads it:
#: what the store did, and the fix in the store's own calls. Keys: ``load_failed_<reason>`` in its stats.
_REFUSED = {
    "integrity_other_key": (
        "the store returned another key's value (its integrity header names another key)",
        "make get() fill each buffer with the value of its own key, in the order the keys were asked",
    ),
    "integrity_short": (
        "the store returned fewer bytes than were put (a short value)",
        "make get() copy the whole value and answer its full length; put() must store every byte it was given",
    ),
    "integrity_checksum": (
        "a value's bytes changed between put() and get() (its checksum does not match)",
        "store and return values byte for byte: no truncation, re-encoding or reuse of the caller's buffer",
    ),
    "missing": (
        "blocks the lookup found were gone when loaded (contains() answered True, get() found nothing)",
        "make contains() answer True only for a key get() can read; put() must answer True only for what it stored",
    ),
}


def store_refusals(records: Sequence[StepRecord]) -> Diagnosis | None:
    """Why a store connector's loads failed, as its store layer counted it (``load_failed_*`` in its stats).

    The store layer verifies every value before a byte reaches a KV cache and
    counts each refusal by reason; a failed load is then the store's fault, and
    the fix is in the store's calls (what ``StoreConformance`` checks), not in
    any hook. ``None`` when no refusal was counted.
    """
    counted: dict[str, float] = {}
    for record in records:
        out = record.connector_output
        for key, value in (out.stats if out is not None else {}).items():
            if key.startswith("load_failed_") and value:
                counted[key.removeprefix("load_failed_")] = counted.get(key.removeprefix("load_failed_"), 0) + value
    known = [(reason, n) for reason, n in counted.items() if reason in _REFUSED]
    if not known:
        return None
    reason, n = max(known, key=lambda item: item[1])
    observed, fix = _REFUSED[reason]
    return Diagnosis(
        f"its store layer refused {n:g} loaded value(s) (load_failed_{reason}): {observed}",
        f"{fix} (kvconn.testing.store_conformance.StoreConformance checks the store's calls one by one)",
    )


def lost_saves(records: Sequence[StepRecord]) -> Diagnosis | None:
    """A run that loaded nothing though the connector counted saves (``blocks_saved``): the store lost them.

    The store layer counts a block saved when the store's ``put`` answered
    True; if no later lookup finds one, ``put`` answered True for what it did
    not keep. ``None`` when nothing was counted saved.
    """
    saved = sum(r.connector_output.stats.get("blocks_saved", 0) for r in records if r.connector_output is not None)
    if not saved:
        return None
    return Diagnosis(
        f"its stats count blocks_saved={saved:g} (the store's put() answered True for each), yet no lookup found one "
        "of them: the store did not keep what put() accepted",
        "make put() answer True only for a value it stored, and contains() and get() find it afterwards "
        "(kvconn.testing.store_conformance.StoreConformance checks the store's calls one by one)",
    )
