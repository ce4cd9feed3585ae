"""Monitors: callbacks around the host's calls, for tools that observe a host (tracers, fault injectors).

Like pluggy's ``add_hookcall_monitoring``, but around the host's methods
rather than pluggy's hook calls: the host calls implementations itself (see
:mod:`.dispatch`), so pluggy's monitoring never sees them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..hookspecs import HOOKS

__all__ = ["MONITORED_CALLS", "STEP_CALLS", "CallOutcome", "MonitorAfter", "MonitorBefore", "Monitored"]


def _host_calls(role: str | None, *, per_step: bool) -> tuple[str, ...]:
    """The host methods calling ``role``'s hooks (``None``: any) that are (or are not) part of a step, in spec order."""
    calls = (t.host_call for t in HOOKS.values() if t.per_step == per_step and (role is None or t.roles == {role}))
    return tuple(dict.fromkeys(calls))


#: The host methods an engine calls in its steps (scheduler side, then worker side, which binds the step's
#: metadata first): those of the per-step hooks of :mod:`kvconn.hookspecs`.
STEP_CALLS = (
    *_host_calls("scheduler", per_step=True),
    "bind_connector_metadata",
    *_host_calls("worker", per_step=True),
)
#: The host methods that call connector hooks (or bind a step's metadata): what monitors can watch.
MONITORED_CALLS = (*STEP_CALLS, *_host_calls(None, per_step=False))


@dataclass
class CallOutcome:
    """How a monitored host call ended: its ``result``, or the ``exception`` it raised (re-raised after)."""

    result: Any = None
    exception: BaseException | None = None


#: ``before(call, args)``: the host method's name and its positional arguments, before it runs.
MonitorBefore = Callable[[str, tuple[Any, ...]], None]
#: ``after(call, args, outcome)``: the same, once it returned or raised.
MonitorAfter = Callable[[str, tuple[Any, ...], CallOutcome], None]


@dataclass(frozen=True, eq=False)
class _Monitor:
    before: MonitorBefore | None
    after: MonitorAfter | None
    calls: frozenset[str]


class Monitored:
    """The host's :meth:`add_monitor`: a mixin of the host classes.

    A call of :data:`MONITORED_CALLS` that the host's role does not have (a
    worker call on a scheduler host) may be watched and is never called.
    """

    _monitors: list[_Monitor]

    def add_monitor(
        self,
        before: MonitorBefore | None = None,
        after: MonitorAfter | None = None,
        *,
        calls: str | Iterable[str] | None = None,
    ) -> Callable[[], None]:
        """Call ``before`` and ``after`` around each of the host's ``calls`` (default: :data:`MONITORED_CALLS`).

        Like pluggy's ``add_hookcall_monitoring``, for the host's calls: a
        monitor sees the live arguments and result (a test driver may act on
        them, e.g. inject a fault into a worker report), ``after`` also sees a
        call that raised (its exception is re-raised once the monitors ran).
        With several monitors the ``before`` callbacks run in the order the
        monitors were added and the ``after`` ones in reverse (the first added
        is the outermost; a ``before`` that raises ends the call for the
        monitors outside it, whose ``after`` sees its exception). Returns the
        undo: it removes this monitor.

        A call no monitor watches costs nothing: only while one is installed
        does the instance hold a wrapper that shadows the method, as pluggy
        swaps its hook executor.
        """
        names = frozenset(MONITORED_CALLS if calls is None else (calls,) if isinstance(calls, str) else calls)
        unknown = sorted(names - set(MONITORED_CALLS))
        if unknown:
            raise ValueError(f"cannot monitor {unknown}: the host's monitored calls are {list(MONITORED_CALLS)}")
        monitor = _Monitor(before, after, names)
        self._monitors.append(monitor)
        self._install_monitors()

        def undo() -> None:
            if monitor in self._monitors:
                self._monitors.remove(monitor)
                self._install_monitors()

        return undo

    def _install_monitors(self) -> None:
        """Shadow each watched call with a wrapper running its monitors; unwatched calls are the plain methods."""
        for call in MONITORED_CALLS:
            watching = [m for m in self._monitors if call in m.calls]
            if watching and hasattr(type(self), call):
                setattr(self, call, self._monitored(call, watching))
            else:
                self.__dict__.pop(call, None)

    def _monitored(self, call: str, monitors: list[_Monitor]) -> Callable[..., Any]:
        method = getattr(type(self), call).__get__(self)
        # (position, callback): the monitors nest, so a before that raises ends the call for those outside it
        befores = [(i, m.before) for i, m in enumerate(monitors) if m.before is not None]
        afters = [(i, m.after) for i, m in reversed(list(enumerate(monitors))) if m.after is not None]
        everyone = len(monitors)

        @functools.wraps(method)
        def monitored(*args: Any, **kwargs: Any) -> Any:
            if kwargs:  # monitors see the arguments positionally, in the method's order
                args = inspect.signature(method).bind(*args, **kwargs).args
            outcome = CallOutcome()
            entered = everyone  # the monitors before this position saw the call begin
            try:
                for entered, before in befores:  # noqa: B007  (read in the except clause)
                    before(call, args)
                entered = everyone
                outcome.result = method(*args)
            except BaseException as exc:
                outcome.exception = exc
                for i, after in afters:
                    if i < entered:
                        after(call, args, outcome)
                raise
            for _, after in afters:
                after(call, args, outcome)
            return outcome.result

        return monitored
