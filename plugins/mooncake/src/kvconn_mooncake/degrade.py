"""Counting degraded paths, and logging each kind once."""

from __future__ import annotations

import logging
from collections import Counter

__all__ = ["Degradations"]

logger = logging.getLogger("kvconn_mooncake")


class Degradations:
    """Counters of what went wrong, with a warning the first time each kind occurs.

    ``counts`` accumulate for the life of the connector; :meth:`take` returns
    and clears what was recorded since the last call (per-step stats).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._since: Counter[str] = Counter()

    def record(self, kind: str, n: int, explanation: str) -> None:
        if n <= 0:
            return
        if not self.counts[kind]:
            logger.warning("mooncake connector: %s (%d so far; logged once, counted as %r)", explanation, n, kind)
        self.counts[kind] += n
        self._since[kind] += n

    def take(self) -> Counter[str]:
        since, self._since = self._since, Counter()
        return since
