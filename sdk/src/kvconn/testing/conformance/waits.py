"""How long a run waits for a connector's async work before calling it stuck: a wall-clock bound.

An idle step (one that schedules nothing while a load or save is in flight)
takes microseconds, so a bound counted in steps alone fails a connector whose
store is merely slow: one behind a socket, on a loaded machine. Every wait of
the conformance runs (a scenario's idle steps, its drain after the last
request, an async load in flight in a data run) is therefore bounded by both
a number of steps *and* :func:`wait_seconds` of wall time, and each idle step
sleeps a little (:class:`IdleSteps`), longer once the wait is long, so that the
connector's own threads get the time and the step limits are not spent on spinning.

The bound defaults to :data:`DEFAULT_WAIT_S`; ``kvconn validate --wait-s``
(or the :data:`WAIT_ENV` environment variable, which worker processes
inherit) raises it.
"""

from __future__ import annotations

import math
import os
import time

__all__ = ["DEFAULT_WAIT_S", "WAIT_ENV", "IdleSteps", "raise_hint", "wait_seconds"]

#: The environment variable that sets the bound, in seconds (``kvconn validate --wait-s`` sets it).
WAIT_ENV = "KVCONN_VALIDATE_WAIT_S"
#: Seconds a run waits without progress by default: ample for a store on this host, short enough for a broken one.
DEFAULT_WAIT_S = 10.0
#: An idle step's sleep for the first :data:`QUICK_IDLE_STEPS` in a row (a load a few steps long waits no longer
#: than it did), then :data:`SLOW_IDLE_SLEEP_S` (a long wait spends a few hundred steps, not thousands).
QUICK_IDLE_SLEEP_S = 0.002
QUICK_IDLE_STEPS = 32
SLOW_IDLE_SLEEP_S = 0.02


def wait_seconds() -> float:
    """The bound in seconds: :data:`WAIT_ENV` when set, else :data:`DEFAULT_WAIT_S`.

    Raises ``ValueError`` naming the variable for a value that is not a positive number of seconds.
    """
    raw = os.environ.get(WAIT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_WAIT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{WAIT_ENV}={raw!r} is not a positive number of seconds: set it to e.g. 30, or unset it")
    return seconds


def raise_hint() -> str:
    """How to give a slow connector more time, for a message that reports a stall."""
    return f"the wait bound is {wait_seconds():g} s: for a store that is merely slow, raise it with --wait-s"


class IdleSteps:
    """Counts the idle steps in a row and the wall time since the first of them; sleeps at each."""

    def __init__(self) -> None:
        self.steps = 0
        self._since = 0.0

    def busy(self) -> None:
        """A step made progress: the count starts again."""
        self.steps = 0

    def idle(self) -> None:
        """A step made no progress: count it, and give the connector's threads some real time."""
        if not self.steps:
            self._since = time.monotonic()
        self.steps += 1
        time.sleep(QUICK_IDLE_SLEEP_S if self.steps <= QUICK_IDLE_STEPS else SLOW_IDLE_SLEEP_S)

    @property
    def seconds(self) -> float:
        """Wall time since the first idle step in a row (0 when the last step made progress)."""
        return time.monotonic() - self._since if self.steps else 0.0

    def exceeded(self, min_steps: int) -> bool:
        """Whether at least ``min_steps`` idle steps and :func:`wait_seconds` have passed without progress."""
        return self.steps >= min_steps and self.seconds >= wait_seconds()

    def describe(self) -> str:
        """``"N steps and S s"``, for a stall message."""
        return f"{self.steps} steps and {self.seconds:.1f} s"
