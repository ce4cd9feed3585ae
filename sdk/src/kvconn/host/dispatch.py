"""The dispatch core both host roles share: registering connectors, calling their hooks, failure accounting.

Why the host calls implementations itself rather than through pluggy's hook
caller (``pm.hook.<name>(...)``, which runs ``pluggy._execution._multicall``):
``_multicall`` calls every implementation inside one loop, last registered
first, and lets the first exception end the whole hook call, discarding the
results of the others; its ``firstresult`` stops at the first non-``None``
answer. The host needs the opposite, each connector on its own
(per-connector isolation), in the order the connectors were given (the
priority order: the first with a hit loads):

* one ``try`` per connector, so a connector that raises loses its work for
  that step and the others' results still count (routing needs every
  answer: the first *hit* loads, every connector may save);
* failure accounting per (connector, hook): the error is logged once with
  the plugin's name, counted (:attr:`HostCore.error_counts`), its first
  message kept (:attr:`HostCore.first_errors`), and under
  ``on_error="raise"`` raised as :class:`~kvconn.errors.ConnectorError`
  naming the connector and the hook;
* each call timed against ``hook_budget_s`` and put down to its connector
  (:attr:`HostCore.slow_calls`), degrading a connector slow too often in a row;
* the answer checked per connector (:mod:`.answers`), a bad one handled as
  the hook raising;
* a connector that failed (or was degraded) sitting out what follows, and
  arguments that differ per connector (the loader gets its tokens, the
  others 0).

pluggy still does what it is for: validating each implementation against
its hookspec at registration (``check_pending``, ``PluginValidationError``)
and listing the implementations of a hook (``get_hookimpls``); the host
adapts each to the spec's positional order once (:func:`_positional`) and
calls it directly, with no hook caller or result object in between (the
host's calls run every step, some once per layer).
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic, perf_counter
from typing import Any, ClassVar, Literal

import pluggy

from .._plugins.manager import KVConnPluginManager, check_side
from ..connector import KVConnectorRole
from ..context import ConnectorContext
from ..errors import ConnectorError, ConnectorLoadError, HookOverBudget
from ..metadata import KVConnectorMetadata
from .answers import BadHookAnswer

__all__ = [
    "DEFAULT_HOOK_BUDGET_S", "DEFAULT_MAX_SLOW_CALLS", "DEFAULT_STALL_S", "DEFAULT_STALL_STEPS", "HostCore",
    "HostOptions", "OnError",
]  # fmt: skip

logger = logging.getLogger("kvconn.host")

OnError = Literal["degrade", "raise"]
#: (connector name, a callable taking the hook's arguments positionally, in spec order)
_Impl = tuple[str, Callable[..., Any]]
#: a hook's arguments in spec order, or a function of the connector's name returning them
Args = tuple[Any, ...] | Callable[[str], tuple[Any, ...]]

#: Steps a connector may keep a request waiting on it (asking to be asked again, a
#: delayed free) before the host gives up on it and degrades the connector, once
#: :data:`DEFAULT_STALL_S` has passed too.
DEFAULT_STALL_STEPS = 128
#: Seconds a connector may keep a request waiting on it, beside :data:`DEFAULT_STALL_STEPS`: a stall
#: counts only past both. Steps alone are no measure of time: a real engine core spins through empty
#: steps (well under a millisecond each) while it waits on KV transfers, so 128 of them can pass
#: while a correct connector's remote lookup or save takes 100 ms. 30 s is far above what a working
#: store needs for one lookup or save (milliseconds to a few seconds on a loaded network), and above
#: ``kvconn validate``'s default wait (10 s, ``testing.conformance.waits.DEFAULT_WAIT_S``): a store
#: slow enough to be degraded by a host on these defaults fails validate too, before a launch, with a
#: message naming the scenario and the fix. Still bounded: blocks a stuck connector holds come back.
DEFAULT_STALL_S = 30.0
#: Seconds one hook call may take before the host warns (once per connector and hook) and counts it.
DEFAULT_HOOK_BUDGET_S = 1.0
#: Calls of one hook in a row over the budget after which a connector is degraded for the rest of the run:
#: a single slow call (a page fault storm, a store's own deadline) is only counted.
DEFAULT_MAX_SLOW_CALLS = 3

_FAILED = object()  # what _call returns for a call that raised


@dataclass(frozen=True)
class HostOptions:
    """How a host treats its connectors' failures and stalls: the one place these options and their defaults live.

    ``on_error``, ``stall_steps``, ``stall_s``, ``hook_budget_s`` and ``max_slow_calls`` as
    :class:`~kvconn.ConnectorHost` documents them; a bad value is refused here,
    naming the option and what it accepts.
    """

    on_error: OnError = "degrade"
    stall_steps: int = DEFAULT_STALL_STEPS
    stall_s: float = DEFAULT_STALL_S
    hook_budget_s: float | None = DEFAULT_HOOK_BUDGET_S
    max_slow_calls: int | None = DEFAULT_MAX_SLOW_CALLS

    def __post_init__(self) -> None:
        if self.on_error not in ("degrade", "raise"):
            raise ValueError(f"on_error must be 'degrade' or 'raise', not {self.on_error!r}")
        if self.stall_steps < 1:
            raise ValueError(f"stall_steps must be >= 1, got {self.stall_steps}")
        if not (isinstance(self.stall_s, (int, float)) and self.stall_s >= 0 and math.isfinite(self.stall_s)):
            raise ValueError(
                f"stall_s must be a number of seconds >= 0 (0: bound stalls by stall_steps alone), got {self.stall_s!r}"
            )
        if self.max_slow_calls is not None and self.max_slow_calls < 1:
            raise ValueError(
                f"max_slow_calls must be >= 1 (or None: never degrade a slow connector), got {self.max_slow_calls}"
            )


def _positional(function: Callable[..., Any], argnames: Sequence[str], spec: Sequence[str]) -> Callable[..., Any]:
    """Adapt an implementation taking a subset of the spec's arguments to all of them, in spec order.

    An implementation that takes every argument in order is called as it is (no extra frame).
    """
    positions = [spec.index(a) for a in argnames]
    if positions == list(range(len(spec))):
        return function
    if not positions:
        return lambda *args: function()
    if len(positions) == 1:
        (i,) = positions
        return lambda *args: function(args[i])
    pick = operator.itemgetter(*positions)
    return lambda *args: function(*pick(args))


class HostCore:
    """Connectors of one role, their hook implementations in order, and the calls with their failure policy.

    A role's host subclasses this with ``hooks`` (the hooks called in that
    role) and sets ``_skip``: the set of connectors its dispatch passes over
    (the scheduler: those degraded for the run; the worker: also those that
    failed earlier in the step). Arguments as for :class:`~kvconn.ConnectorHost`, its options in one
    :class:`HostOptions`.
    """

    #: the hooks this role calls
    hooks: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        connectors: Mapping[str, object] | Sequence[tuple[str, object]],
        *,
        role: KVConnectorRole | str,
        context: ConnectorContext | None,
        options: HostOptions,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.options = options
        # Read on every call: plain attributes, a missing bound as infinity.
        self.stall_steps = options.stall_steps
        self.stall_s = options.stall_s
        #: seconds, for ``stall_s``: monotonic, and read only once a wait has lasted ``stall_steps`` steps
        self.clock = clock
        self.hook_budget_s = math.inf if options.hook_budget_s is None else options.hook_budget_s
        self.max_slow_calls = math.inf if options.max_slow_calls is None else options.max_slow_calls
        items = list(connectors.items() if isinstance(connectors, Mapping) else connectors)
        self.role = KVConnectorRole(role)
        self.context = context or ConnectorContext()
        self.on_error: OnError = options.on_error
        self.connectors: dict[str, object] = {}
        #: each connector's ``Metadata`` class (what its workers decode)
        self.metadata_types: dict[str, type[KVConnectorMetadata]] = {}
        self._pm = KVConnPluginManager()
        for name, connector in items:
            self._register(name, connector)
        order = {name: i for i, name in enumerate(self.connectors)}
        self._impls: dict[str, list[_Impl]] = {}
        for hook in self.hooks:
            caller = getattr(self._pm.hook, hook)
            spec = caller.spec.argnames
            impls = sorted(caller.get_hookimpls(), key=lambda i: order[i.plugin_name])
            self._impls[hook] = [(i.plugin_name, _positional(i.function, i.argnames, spec)) for i in impls]
        self.error_counts: Counter[tuple[str, str]] = Counter()
        #: the first error of each (connector, hook), as ``"Type: message"``
        self.first_errors: dict[tuple[str, str], str] = {}
        #: hook calls longer than ``hook_budget_s``, per (connector, hook)
        self.slow_calls: Counter[tuple[str, str]] = Counter()
        self._slow_in_a_row: dict[tuple[str, str], int] = {}  # reset by a call within the budget
        self._failed_this_step: set[str] = set()
        #: connectors out for the rest of the run: a failed register_kv_caches, max_slow_calls overruns in a row
        self._disabled: set[str] = set()
        self._skip: set[str] = self._disabled

    def _register(self, name: str, connector: object) -> None:
        if name in self.connectors:
            raise ConnectorLoadError(f"connector {name!r} is given twice: each connector needs a distinct name")
        check_side(name, connector, self.role.value)
        try:
            self._pm.register_connector(connector, name=name)  # its side for this role, if it declares one
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise ConnectorLoadError(f"connector {name!r} has an invalid hook implementation: {exc}") from exc
        self.connectors[name] = connector
        self.metadata_types[name] = getattr(connector, "Metadata", KVConnectorMetadata)

    @property
    def names(self) -> list[str]:
        return list(self.connectors)

    def implementers(self, hook: str) -> list[str]:
        """The connectors implementing ``hook``, in order: an engine need not prepare what no connector reads."""
        return [name for name, _ in self._impls.get(hook, ())]

    @property
    def degraded_events(self) -> int:
        """How many hook calls failed and were degraded."""
        return sum(self.error_counts.values())

    # Every hook call is one connector's call through _call (guarded, timed, its answer checked), from _each or
    # from a role's own loop, except the per-layer loops (layers x connectors a step), which guard each call and
    # time the layer as a whole. Either way: one ``try`` per connector, arguments positional in spec order, a
    # call's time booked by _book.

    def _stalled(self, steps: int, since: float) -> bool:
        """Whether a wait that began at ``clock()`` time ``since`` and has lasted ``steps`` steps is a stall.

        Past both bounds: more than ``stall_steps`` steps and more than ``stall_s``
        seconds (``stall_s=0``: the steps alone). The clock is read only past the steps.
        """
        return steps > self.stall_steps and (not self.stall_s or self.clock() - since > self.stall_s)

    def _stall_bounds(self) -> str:
        """The bounds, for a message that reports a stall."""
        if not self.stall_s:
            return f"{self.stall_steps} steps (stall_steps; stall_s=0)"
        return f"{self.stall_steps} steps and {self.stall_s:g} s (stall_steps, stall_s)"

    def _fail(self, name: str, hook: str, exc: Exception) -> None:
        """Account for connector ``name`` failing in ``hook``: it loses its work for this step (or it raises)."""
        if self.on_error == "raise":
            raise ConnectorError(name, hook, exc) from exc
        key = (name, hook)
        if not self.error_counts[key]:
            self.first_errors[key] = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "connector %r failed in %s; its work for this step is dropped (degraded): %s: %s",
                name, hook, type(exc).__name__, exc, exc_info=None if isinstance(exc, BadHookAnswer) else exc,
                extra={"kvconn_hook_failure": key},
            )  # fmt: skip
        self.error_counts[key] += 1
        self._failed_this_step.add(name)

    def _slow(self, name: str, hook: str, seconds: float) -> None:
        """Count a hook call over the time budget; warn about the first per (connector, hook).

        The ``max_slow_calls``-th in a row degrades the connector for the rest of the run.
        """
        key = (name, hook)
        if not self.slow_calls[key]:
            logger.warning(
                "connector %r took %.3f s in %s, over the hook budget of %.3f s: the engine waited for it "
                "(warned once; counted in slow_calls)",
                name, seconds, hook, self.hook_budget_s,
            )  # fmt: skip
        self.slow_calls[key] += 1
        in_a_row = self._slow_in_a_row[key] = self._slow_in_a_row.get(key, 0) + 1
        if in_a_row >= self.max_slow_calls and name not in self._disabled:
            self._disabled.add(name)
            self._fail(name, hook, HookOverBudget(hook, in_a_row, self.hook_budget_s, seconds))

    def _book(self, name: str, hook: str, seconds: float) -> None:
        """Book one call's time: a slow call, or one within the budget that may end a run of slow ones.

        Callers test ``seconds > hook_budget_s or _slow_in_a_row`` first: the usual call books nothing.
        """
        if seconds > self.hook_budget_s:
            self._slow(name, hook, seconds)
        else:
            self._in_budget(name, hook)

    def _in_budget(self, name: str, hook: str) -> None:
        """A call within the budget ends a run of slow ones."""
        if self._slow_in_a_row:
            self._slow_in_a_row.pop((name, hook), None)

    def _each(self, hook: str, args: Args, check: Callable[[Any], Any] | None = None) -> Iterable[tuple[str, Any]]:
        """Call ``hook`` on every connector implementing it, in order; yield ``(name, result)`` of the successes.

        ``args`` are the spec's arguments in order, or a function of the
        connector's name returning them. ``check`` validates and converts a
        result; a :class:`~.answers.BadHookAnswer` it raises is a failure of
        the hook. A connector in ``_skip`` is not called. A hook nobody
        implements costs no generator, and one implemented by a single
        connector (the usual host) is called at once, its answer returned in
        a tuple: the same call, one layer less.
        """
        impls = self._impls[hook]
        if not impls:
            return ()
        if len(impls) > 1:
            return self._call_each(impls, hook, args, check)
        name, call = impls[0]
        if name in self._skip:
            return ()
        result = self._call(name, call, hook, args(name) if callable(args) else args, check)
        return () if result is _FAILED else ((name, result),)

    def _call_each(
        self, impls: list[_Impl], hook: str, args: Args, check: Callable[[Any], Any] | None
    ) -> Iterator[tuple[str, Any]]:
        for name, call in impls:
            if name in self._skip:  # read at each connector: one may fail while an earlier one's result is handled
                continue
            result = self._call(name, call, hook, args(name) if callable(args) else args, check)
            if result is not _FAILED:
                yield name, result

    def _call(
        self, name: str, call: Callable[..., Any], hook: str, args: tuple[Any, ...], check: Callable[[Any], Any] | None
    ) -> Any:
        """One connector's call of ``hook``, guarded and timed against the budget: its (checked) result, or ``_FAILED``.

        The one way a hook is called (but the per-layer loops, see above): ``args``
        in spec order; ``check`` validates and converts the answer, a
        :class:`~.answers.BadHookAnswer` (or any exception) it raises being a
        failure of the hook.
        """
        started = perf_counter()
        try:
            result = call(*args)
            if check is not None:
                result = check(result)
        except Exception as exc:
            self._fail(name, hook, exc)
            result = _FAILED
        if (elapsed := perf_counter() - started) > self.hook_budget_s or self._slow_in_a_row:
            self._book(name, hook, elapsed)
        return result

    def _notify(self, hook: str, args: Args = ()) -> None:
        """Call ``hook`` on every connector for its side effects (``args`` as for :meth:`_each`)."""
        for _ in self._each(hook, args):
            pass
