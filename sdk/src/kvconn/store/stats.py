"""Counters of a store connector side, with each degraded kind logged once."""

from __future__ import annotations

import logging
from collections import Counter

from ..telemetry import DEGRADED_PREFIX

__all__ = ["StoreStats"]

logger = logging.getLogger("kvconn.store")


class StoreStats:
    """What moved and what degraded; :meth:`take` returns and clears what happened since the last call.

    ``degraded_events`` (in :meth:`take`) sums the degraded counts, so an engine
    that adds it up reports a store outage rather than zero; ``degraded.<kind>``
    (:data:`kvconn.telemetry.DEGRADED_PREFIX`) holds each kind's share, which
    engine adapters export as degraded events by reason.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.totals: Counter[str] = Counter()
        self._since: Counter[str] = Counter()
        self._degraded: Counter[str] = Counter()

    def count(self, key: str, n: int) -> None:
        if n > 0:
            self.totals[key] += n
            self._since[key] += n

    def degraded(self, kind: str, n: int, explanation: str) -> None:
        """``n`` blocks degraded for ``kind`` (no save, or recompute); the first of each kind is logged."""
        if n <= 0:
            return
        if not self.totals[kind]:
            logger.warning("%s: %s (counted as %r; logged once)", self.name, explanation, kind)
        self.count(kind, n)
        self._degraded[kind] += n

    def take(self) -> dict[str, float]:
        if not self._since:
            return {}  # most steps: nothing moved, nothing to allocate
        since, self._since = self._since, Counter()
        degraded, self._degraded = self._degraded, Counter()
        if degraded:
            since["degraded_events"] = sum(degraded.values())
            since.update({DEGRADED_PREFIX + kind: n for kind, n in degraded.items()})
        return {key: float(value) for key, value in since.items()}
