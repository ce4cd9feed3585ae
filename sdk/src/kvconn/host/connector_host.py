"""``ConnectorHost``: one or several connectors behind one typed facade.

Engines talk to connectors only through a host; nothing else touches
``pm.hook``. The host calls each connector in turn, in the order they were
given, so that it can

* route results: the first connector that reports matched tokens loads the
  request; every connector may save; metadata is a ``{name: metadata}`` dict and
  each worker-side connector sees only its own;
* contain failures: under ``on_error="degrade"`` (the default) a connector that
  raises loses its work for that step and nothing else. Its loads in flight are
  reported as failed so the engine recomputes them (never runs on wrong KV),
  frees it was delaying are released, the error is logged once per
  (connector, hook) with the plugin's name and counted. Under ``"raise"`` the
  error surfaces as :class:`~kvconn.errors.ConnectorError`;
* check answers: what a per-step hook returns is validated here (types, whole-block
  hits, load errors and finished loads that belong to the connector's own loads);
  a bad answer is handled as if the hook had raised, with an error naming the
  connector, the hook and the value. The per-layer hooks return nothing and are
  not checked (they are the hot path);
* bound what a connector can stall: a request it keeps asking to be asked
  again about, or a free it delays, for more than ``stall_steps`` steps, is
  failed as above, and a hook call longer than ``hook_budget_s`` is warned
  about once per (connector, hook) and counted. A connector whose calls of
  one hook overrun the budget ``max_slow_calls`` times in a row is degraded
  for the rest of the run: the host calls it no more, so later steps do not
  wait on it (a worker side sits out every step, its loads recompute). One
  call that blocks cannot be cut short: Python cannot interrupt a running
  function, and abandoning a worker call that may still write into the KV
  cache could put wrong KV in front of a request; a connector bounds its own
  blocking work (kvconn-mooncake puts a deadline on every store call). An
  async load it never reports is not bounded either: its worker may still be
  writing into those blocks, so handing them to another request could put
  wrong KV in front of it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from time import perf_counter
from typing import Any, Literal

import pluggy

from .._plugins.manager import KVConnPluginManager
from .._plugins.registry import connector_roles, instantiate_connector, load_connector_class
from .._plugins.sides import declared_side, refuse_sides_off_kvconnector
from ..block_state import BlockIds, KVConnectorBlockState, block_ids_in_range
from ..connector import KVConnector, KVConnectorRole
from ..context import ConnectorContext
from ..errors import ConnectorConfigError, ConnectorError, ConnectorLoadError
from ..hookspecs import SCHEDULER_HOOKS, WORKER_HOOKS
from ..metadata import KVConnectorMetadata
from ..outputs import KVConnectorOutput, SchedulerOutput
from ..request import ConnectorRequest

__all__ = [
    "DEFAULT_HOOK_BUDGET_S",
    "DEFAULT_MAX_SLOW_CALLS",
    "DEFAULT_STALL_STEPS",
    "MONITORED_CALLS",
    "CallOutcome",
    "ConnectorHost",
    "LoadPlan",
    "MonitorAfter",
    "MonitorBefore",
    "STEP_CALLS",
    "StepUpdate",
]

logger = logging.getLogger("kvconn.host")

OnError = Literal["degrade", "raise"]
#: (connector name, a callable taking the hook's arguments positionally, in spec order)
_Impl = tuple[str, Callable[..., Any]]

#: Steps a connector may keep a request waiting on it (asking to be asked again, a
#: delayed free) before the host gives up on it and degrades the connector.
DEFAULT_STALL_STEPS = 128
#: Seconds one hook call may take before the host warns (once per connector and hook) and counts it.
DEFAULT_HOOK_BUDGET_S = 1.0
#: Calls of one hook in a row over the budget after which a connector is degraded for the rest of the run:
#: a single slow call (a page fault storm, a store's own deadline) is only counted.
DEFAULT_MAX_SLOW_CALLS = 3


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


@dataclass(frozen=True)
class LoadPlan:
    """The host's answer to "can a connector load this request's prefix?".

    ``num_tokens`` is ``None`` when a connector asked to be asked again later.
    """

    num_tokens: int | None = 0
    load_async: bool = False
    connector: str | None = None


NO_LOAD = LoadPlan()
_FAILED = object()  # what _each holds for a call that raised
_NO_HIT = (0, False)


@dataclass
class StepUpdate:
    """What the scheduler must apply after a step, merged over all connectors.

    ``finished_sending``: requests whose delayed blocks may now be freed.
    ``finished_recving``: async loads that ended (successfully or not: failed
    blocks are in ``invalid_block_ids``, which the engine must recompute).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: Counter[str] = field(default_factory=Counter)


@dataclass
class _Load:
    block_ids: list[int]
    is_async: bool
    sent: bool = False  # its metadata reached the workers


#: The host methods an engine calls in its steps (scheduler side, then worker side).
STEP_CALLS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
)
#: The host methods that call connector hooks (or bind a step's metadata): what monitors can watch.
MONITORED_CALLS = (*STEP_CALLS, "register_kv_caches", "num_tracked_requests", "shutdown")


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


class BadHookAnswer(TypeError):
    """A hook returned something outside its contract; handled as if the hook had raised it."""


def _finished(result: object) -> tuple[set[str], set[str]]:
    """``get_finished``'s answer: ``(finished_sending, finished_recving)``, each ``None`` or request ids."""
    if result is None:
        return set(), set()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise BadHookAnswer(f"returned {result!r}, not (finished_sending, finished_recving)")
    return _id_set(result[0], "finished_sending", str), _id_set(result[1], "finished_recving", str)


def _block_ids(result: object) -> set[int]:
    """``get_block_ids_with_load_errors``'s answer: ``None`` or block ids."""
    return _id_set(result, "block ids", int)


def _count(result: object) -> int | None:
    """``get_num_tracked_requests``'s answer: ``None`` or an int >= 0."""
    if result is not None and (not isinstance(result, Integral) or isinstance(result, bool) or result < 0):
        raise BadHookAnswer(f"returned {result!r}, not an int >= 0 or None")
    return None if result is None else int(result)


def _id_set(value: object, what: str, kind: type) -> set[Any]:
    """``value`` (``None`` or an iterable of ``kind``) as a set, or :class:`BadHookAnswer` naming ``what``."""
    if not value and isinstance(value, (set, frozenset, list, tuple, type(None))):
        return set()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BadHookAnswer(f"returned {what} {value!r}, not a set of {kind.__name__}")
    try:
        items = set(value)
    except TypeError as exc:
        raise BadHookAnswer(f"returned {what} that cannot be a set: {exc}") from None
    ok = Integral if kind is int else kind
    bad = next((v for v in items if not isinstance(v, ok) or isinstance(v, bool)), None)
    if bad is not None:
        raise BadHookAnswer(f"returned {what} holding {bad!r} ({type(bad).__name__}), not {kind.__name__}")
    return {int(v) for v in items} if kind is int else items


def _stats(value: object) -> dict[str, float]:
    """``value`` (``None`` or a mapping of names to finite numbers) as a dict, or :class:`BadHookAnswer`."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadHookAnswer(f"returned {value!r}, not a mapping of stat names to numbers")
    for key, number in value.items():
        if not isinstance(key, str) or not isinstance(number, Real) or not math.isfinite(number):
            raise BadHookAnswer(f"returned stat {key!r}: {number!r}, not a name and a finite number")
    return dict(value)


class ConnectorHost:
    """Runs connectors of one role for an engine.

    Args:
        connectors: ``{name: connector}`` or ``[(name, connector), ...]``, in
            priority order (the first with a hit loads).
        role: the side of the engine this host serves.
        context: the engine facts (block size is used to map loads to blocks).
        on_error: ``"degrade"`` (default) or ``"raise"``.
        stall_steps: steps without progress a connector may cause (see the module docstring).
        hook_budget_s: seconds a hook call may take before it is warned about and
            counted in :attr:`slow_calls`; ``None``: no budget.
        max_slow_calls: calls of one hook in a row over ``hook_budget_s`` after which
            the connector is degraded for the rest of the run (its hooks are no longer
            called; counted as a failure of that hook); ``None``: only warn and count.
    """

    def __init__(
        self,
        connectors: Mapping[str, object] | Sequence[tuple[str, object]],
        *,
        role: KVConnectorRole | str,
        context: ConnectorContext | None = None,
        on_error: OnError = "degrade",
        stall_steps: int = DEFAULT_STALL_STEPS,
        hook_budget_s: float | None = DEFAULT_HOOK_BUDGET_S,
        max_slow_calls: int | None = DEFAULT_MAX_SLOW_CALLS,
    ) -> None:
        if on_error not in ("degrade", "raise"):
            raise ValueError(f"on_error must be 'degrade' or 'raise', not {on_error!r}")
        if stall_steps < 1:
            raise ValueError(f"stall_steps must be >= 1, got {stall_steps}")
        if max_slow_calls is not None and max_slow_calls < 1:
            raise ValueError(
                f"max_slow_calls must be >= 1 (or None: never degrade a slow connector), got {max_slow_calls}"
            )
        self.stall_steps = stall_steps
        self.hook_budget_s = math.inf if hook_budget_s is None else hook_budget_s
        self.max_slow_calls = math.inf if max_slow_calls is None else max_slow_calls
        items = list(connectors.items() if isinstance(connectors, Mapping) else connectors)
        self.role = KVConnectorRole(role)
        self.context = context or ConnectorContext()
        self.on_error: OnError = on_error
        self.connectors: dict[str, object] = {}
        #: each connector's ``Metadata`` class (what its workers decode)
        self.metadata_types: dict[str, type[KVConnectorMetadata]] = {}
        self._pm = KVConnPluginManager()
        for name, connector in items:
            self._register(name, connector)
        hooks = SCHEDULER_HOOKS if self.role is KVConnectorRole.SCHEDULER else WORKER_HOOKS
        order = {name: i for i, name in enumerate(self.connectors)}
        self._impls: dict[str, list[_Impl]] = {}
        for hook in hooks:
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
        self._step = 0  # update_connector_output calls: the scheduler's step count
        self._asks: dict[tuple[str, str], int] = {}  # (connector, request) -> "ask again" answers in a row
        self._send_steps: dict[str, int] = {}  # delayed free -> the step it began
        # scheduler side: loads in flight per connector, frees delayed per request
        self._loads: dict[str, dict[str, _Load]] = {name: {} for name in self.connectors}
        #: per connector, async loads failed while in flight (request id -> step): a later report of one is no stray
        self._abandoned: dict[str, dict[str, int]] = {name: {} for name in self.connectors}
        self._sending: dict[str, set[str]] = {}
        self._failed_this_step: set[str] = set()
        # worker side: this step's metadata per connector; connectors whose
        # register_kv_caches failed hold no caches and sit out every step
        self._metadata: dict[str, KVConnectorMetadata] = {}
        #: connectors out for the rest of the run: a failed register_kv_caches, max_slow_calls overruns in a row
        self._disabled: set[str] = set()
        # A step's calls of hooks nobody implements are skipped whole (most steps of most connectors).
        self._layered = any(self._impls.get(h) for h in ("start_load_kv", "save_kv_layer", "wait_for_layer_load"))
        self._reporting = any(
            self._impls.get(h) for h in ("get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats")
        )
        self._plan_layers()
        self._monitors: list[_Monitor] = []

    @classmethod
    def from_names(
        cls,
        names: str | Sequence[str],
        *,
        role: KVConnectorRole | str,
        config: Mapping[str, Any] | None = None,
        context: ConnectorContext | None = None,
        on_error: OnError = "degrade",
        stall_steps: int = DEFAULT_STALL_STEPS,
        hook_budget_s: float | None = DEFAULT_HOOK_BUDGET_S,
        max_slow_calls: int | None = DEFAULT_MAX_SLOW_CALLS,
    ) -> ConnectorHost:
        """Load connectors by name (or ``"pkg.mod:Class"``) and host them.

        With one name, ``config`` is that connector's config; with several, it
        maps each name to its config. Connectors that do not serve ``role``
        (a scheduler-only connector on a worker) are left out.
        """
        name_list = [names] if isinstance(names, str) else list(names)
        configs: Mapping[str, Any] = {name_list[0]: config} if len(name_list) == 1 else (config or {})
        unknown = set(configs) - set(name_list)
        if unknown:
            raise ValueError(f"config given for connectors that are not loaded: {sorted(unknown)}")
        ctx = context or ConnectorContext()
        role = KVConnectorRole(role)
        classes = [(n, load_connector_class(n)) for n in name_list]
        loaded = [
            (n, instantiate_connector(c, n, role=role, config=configs.get(n), context=ctx))
            for n, c in classes
            if role in connector_roles(c)
        ]
        return cls(
            loaded,
            role=role,
            context=ctx,
            on_error=on_error,
            stall_steps=stall_steps,
            hook_budget_s=hook_budget_s,
            max_slow_calls=max_slow_calls,
        )

    def _register(self, name: str, connector: object) -> None:
        if name in self.connectors:
            raise ConnectorLoadError(f"connector {name!r} is given twice: each connector needs a distinct name")
        self._check_side(name, connector)
        try:
            self._pm.register_connector(connector, name=name)  # its side for this role, if it declares one
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise ConnectorLoadError(f"connector {name!r} has an invalid hook implementation: {exc}") from exc
        self.connectors[name] = connector
        self.metadata_types[name] = getattr(connector, "Metadata", KVConnectorMetadata)

    def _check_side(self, name: str, connector: object) -> None:
        """Refuse a connector with sides whose registered object would not be its side for this host's role.

        Its hooks live on its sides, so registering anything else (the side of
        the other role, or the bare connector) would leave this role without
        hooks: every save and load silently skipped.
        """
        cls, role = type(connector), self.role.value
        if not isinstance(connector, KVConnector):
            refuse_sides_off_kvconnector(cls)
            return
        if all(declared_side(cls, r.value) is None for r in KVConnectorRole):
            return  # a connector that is its own hooks serves either role
        built_for = getattr(connector, "role", None)
        if built_for is not None and built_for != self.role:  # a str enum: "worker" (a str) is the worker role
            built = getattr(built_for, "value", built_for)
            raise ConnectorLoadError(
                f"connector {name!r} ({cls.__qualname__}) was built for the {built} role, not the {role} role of "
                "this host: its hooks are on the side of its role; build one instance per role"
            )
        if declared_side(cls, role) is not None and getattr(connector, "side", None) is None:
            raise ConnectorLoadError(
                f"connector {name!r}: {cls.__qualname__} declares a {role}_side but has no side built: its "
                "__init__ must call super().__init__(config, role=role, context=context), which builds it"
            )

    @property
    def names(self) -> list[str]:
        return list(self.connectors)

    @property
    def awaits_reports(self) -> bool:
        """Whether a connector has a transfer in flight (a load, a delayed free) that its workers must report.

        The stall bound counts :meth:`update_connector_output` calls: an engine
        that leaves out empty worker reports must still deliver one every step
        while this holds.
        """
        return bool(self._sending) or any(self._loads.values()) or any(self._abandoned.values())

    def _in_flight(self, name: str) -> bool:
        """Whether connector ``name`` has a load (or an abandoned one) its workers have still to report."""
        return bool(self._loads[name] or self._abandoned[name])

    def implementers(self, hook: str) -> list[str]:
        """The connectors implementing ``hook``, in order: an engine need not prepare what no connector reads."""
        return [name for name, _ in self._impls.get(hook, ())]

    @property
    def degraded_events(self) -> int:
        """How many hook calls failed and were degraded."""
        return sum(self.error_counts.values())

    # --------------------------------------------------------------- monitoring

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
            if watching:
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

    # ------------------------------------------------------------------ calling
    # Every hook call goes through _each (or the per-layer loops below): one
    # ``try`` per connector, arguments passed positionally in spec order.

    def _fail(self, name: str, hook: str, exc: Exception) -> None:
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
        if self.role is KVConnectorRole.WORKER:
            self._plan_layers()  # it sits out the rest of the step

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
            self._fail(
                name,
                hook,
                TimeoutError(
                    f"{in_a_row} calls in a row took longer than the hook budget of {self.hook_budget_s:g} s "
                    f"(the last {seconds:.3f} s): degraded for the rest of the run, the engine no longer calls it"
                ),
            )

    def _in_budget(self, name: str, hook: str) -> None:
        """A call within the budget ends a run of slow ones."""
        if self._slow_in_a_row:
            self._slow_in_a_row.pop((name, hook), None)

    def _each(
        self,
        hook: str,
        args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]],
        check: Callable[[Any], Any] | None = None,
    ) -> Iterable[tuple[str, Any]]:
        """Call ``hook`` on every connector implementing it, in order; yield ``(name, result)`` of the successes.

        ``args`` are the spec's arguments in order, or a function of the
        connector's name returning them. ``check`` validates and converts a
        result; a :class:`BadHookAnswer` it raises is a failure of the hook.
        On the worker, a connector that raised earlier in the step sits out
        the rest of it. A hook nobody implements costs no generator, and one
        implemented by a single connector (the usual host) is called at once,
        its answer returned in a tuple: the same call, one layer less.
        """
        impls = self._impls[hook]
        if not impls:
            return ()
        if len(impls) > 1:
            return self._call_each(impls, hook, args, check)
        name, call = impls[0]
        if name in (self._failed_this_step if self.role is KVConnectorRole.WORKER else self._disabled):
            return ()
        result = self._call(name, call, hook, args, check)
        return () if result is _FAILED else ((name, result),)

    def _call_each(
        self,
        impls: list[_Impl],
        hook: str,
        args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]],
        check: Callable[[Any], Any] | None,
    ) -> Iterator[tuple[str, Any]]:
        skip = self._failed_this_step if self.role is KVConnectorRole.WORKER else self._disabled
        for name, call in impls:
            if name in skip:  # read at each connector: one may fail while an earlier one's result is handled
                continue
            result = self._call(name, call, hook, args, check)
            if result is not _FAILED:
                yield name, result

    def _call(
        self,
        name: str,
        call: Callable[..., Any],
        hook: str,
        args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]],
        check: Callable[[Any], Any] | None,
    ) -> Any:
        """One connector's call of ``hook``, timed against the budget: its (checked) result, or ``_FAILED``."""
        started = perf_counter()
        try:
            result = call(*(args(name) if callable(args) else args))
            if check is not None:
                result = check(result)
        except Exception as exc:
            self._fail(name, hook, exc)
            result = _FAILED
        if (elapsed := perf_counter() - started) > self.hook_budget_s:
            self._slow(name, hook, elapsed)
        elif self._slow_in_a_row:
            self._in_budget(name, hook)
        return result

    def _notify(self, hook: str, args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]] = ()) -> None:
        """Call ``hook`` on every connector for its side effects (``args`` as for :meth:`_each`)."""
        for _ in self._each(hook, args):
            pass

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> LoadPlan:
        """Ask each connector in order; the first that reports tokens loads.

        A bad answer (see :meth:`_check_match`) counts as no hit. A connector
        that asks to be asked again about one request more than
        ``stall_steps`` times in a row is failed once, then counts as having
        no hit for that request.
        """
        req_id = request.request_id
        num_tokens: int | None
        for name, result in self._each("get_num_new_matched_tokens", (request, num_computed_tokens)):
            if result is None or (result.__class__ is tuple and result == _NO_HIT):  # the usual answer, checked fast
                num_tokens, load_async = 0, False
            else:
                try:
                    num_tokens, load_async = self._check_match(result, request, num_computed_tokens)
                except BadHookAnswer as exc:
                    self._fail(name, "get_num_new_matched_tokens", exc)
                    continue
            if num_tokens is None:
                asks = self._asks[name, req_id] = self._asks.get((name, req_id), 0) + 1
                if asks <= self.stall_steps:
                    return LoadPlan(None, False, name)
                if asks == self.stall_steps + 1:
                    self._fail(
                        name,
                        "get_num_new_matched_tokens",
                        BadHookAnswer(
                            f"asked to be asked again about request {req_id!r} {self.stall_steps} times in a row "
                            "(stall_steps); the engine stops waiting for it and computes the request"
                        ),
                    )
                continue
            if self._asks:
                self._asks.pop((name, req_id), None)
            if num_tokens > 0:
                return LoadPlan(num_tokens, load_async, name)
        return NO_LOAD

    def _check_match(
        self, result: object, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(num_tokens, load_async)`` from a lookup answer, or :class:`BadHookAnswer`.

        ``num_tokens`` must be an int >= 0 or ``None``, ``load_async`` a bool,
        and a hit must end on a block boundary unless it reaches the last
        token (the engine then trims it to whole blocks): the engine loads
        whole blocks, so a hit ending inside one would leave that block's
        tail uncomputed.
        """
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise BadHookAnswer(f"returned {result!r}, not (num_tokens, load_async)")
        num_tokens, load_async = result
        if type(num_tokens) is not int and (  # the exact type first: the ABC check is slow, and this is per request
            num_tokens is not None and (not isinstance(num_tokens, Integral) or isinstance(num_tokens, bool))
        ):
            raise BadHookAnswer(f"returned num_tokens={num_tokens!r} ({type(num_tokens).__name__}), not an int or None")
        if type(load_async) is not bool and not isinstance(load_async, int):
            raise BadHookAnswer(f"returned load_async={load_async!r} ({type(load_async).__name__}), not a bool")
        if num_tokens is None:
            return None, False
        num_tokens = int(num_tokens)
        end, block_size = num_computed_tokens + num_tokens, self.context.block_size
        if num_tokens < 0 or (end % block_size and end < request.num_tokens - 1):
            raise BadHookAnswer(
                f"returned num_tokens={num_tokens} after {num_computed_tokens} computed tokens: a hit must be >= 0 "
                f"and end on a block boundary (block size {block_size}), the engine loads whole blocks"
            )
        return num_tokens, bool(load_async)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds, plan: LoadPlan) -> bool:
        """Tell every connector about the allocation; the planned loader gets its tokens.

        Returns whether the planned load is still on (``False`` if the loader
        failed here: the engine then computes those tokens itself).
        """
        num_external = plan.num_tokens or 0
        loading = False
        for name, _ in self._each(
            "update_state_after_alloc",
            lambda name: (request, block_ids, num_external if name == plan.connector else 0),
        ):
            if name == plan.connector and num_external:
                start = request.num_computed_tokens
                blocks = block_ids_in_range(block_ids, start, start + num_external, self.context.block_size)
                self._loads[name][request.request_id] = _Load(blocks, plan.load_async)
                loading = True
        return loading

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> dict[str, KVConnectorMetadata]:
        """``on_block_state`` then ``build_connector_meta`` on every connector.

        ``scheduler_output.kv_connector_block_state`` is set for the duration of
        the call (legacy connectors read it there) and ``None`` afterwards.
        A connector that fails, or returns something that is not its
        ``Metadata``, sends no metadata this step and its loads are failed.
        """
        scheduler_output.kv_connector_block_state = block_state
        self._failed_this_step.clear()
        try:
            if self._impls["on_block_state"]:
                self._notify("on_block_state", (block_state, scheduler_output))
            metadata: dict[str, KVConnectorMetadata] = {}
            for name, meta in self._each("build_connector_meta", (scheduler_output, block_state)):
                if name in self._failed_this_step:
                    continue
                expected = self.metadata_types[name]
                if not isinstance(meta, expected):
                    self._fail(
                        name,
                        "build_connector_meta",
                        TypeError(f"returned {type(meta).__name__}, not an instance of {expected.__name__}"),
                    )
                    continue
                metadata[name] = meta
                for load in self._loads[name].values():
                    load.sent = True
            return metadata
        finally:
            scheduler_output.kv_connector_block_state = None

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> bool:
        """Tell every connector; returns whether any delays freeing the blocks.

        An answer other than a bool (or ``(bool, params)``) is a bad answer: no delay.
        """
        req_id = request.request_id
        delayed = set()
        for name, result in self._each("request_finished", (request, block_ids)):
            delay = result[0] if isinstance(result, tuple) and result else result
            if delay is not None and not isinstance(delay, (bool, int)):
                self._fail(
                    name, "request_finished", BadHookAnswer(f"returned {result!r}, not a bool or (bool, params)")
                )
            elif delay:
                delayed.add(name)
            if self._asks:
                self._asks.pop((name, req_id), None)
        if delayed:
            self._sending[req_id] = delayed
            self._send_steps[req_id] = self._step
        return bool(delayed)

    def update_connector_output(self, outputs: Mapping[str, KVConnectorOutput]) -> StepUpdate:
        """Hand each connector its worker report and merge what the engine must do."""
        update = StepUpdate()
        self._step += 1
        if not outputs and not self._impls["update_connector_output"] and not self.awaits_reports:
            return update  # no report, nothing in flight, nobody to tell: the usual step
        empty = KVConnectorOutput()
        self._notify("update_connector_output", lambda name: (outputs.get(name, empty),))
        for name in self.connectors:
            out = outputs.get(name, empty)
            if out.is_empty() and not (self._sending or self._in_flight(name)):
                continue  # nothing in flight, nothing reported: the usual step of a connector
            update.stats.update(out.stats)
            failed = out.failed or not self._report_ok(name, out)
            self._settle_loads(name, out, failed, update)
            # Only a worker side that raised has lost its sends: after a bad answer it may still be reading
            # the blocks of a delayed free, so those stay held (the stall bound still applies).
            self._settle_sends(name, out, out.failed, update)
            if not failed:
                update.invalid_block_ids |= out.invalid_block_ids
        return update

    def _report_ok(self, name: str, out: KVConnectorOutput) -> bool:
        """Whether a worker report speaks only of the connector's own loads; a bad one fails its step.

        ``finished_recving`` may name only its async loads in flight (not a
        sync load, not another connector's), and ``invalid_block_ids`` only
        blocks of its loads in flight: anything else would make the engine
        land a load nobody made, or recompute (forever) blocks it computed.
        """
        loads, abandoned = self._loads[name], self._abandoned[name]
        late = out.finished_recving & abandoned.keys()
        for req_id in late:  # a load already failed (a step it raised in): its worker finished it after all
            del abandoned[req_id]
        for req_id in [r for r, step in abandoned.items() if self._step - step > self.stall_steps]:
            del abandoned[req_id]  # never reported: forget it
        stray: list[Any] = sorted(r for r in out.finished_recving - late if r not in loads or not loads[r].is_async)
        if stray:
            hook, what = "get_finished", f"{stray[:8]} in finished_recving, which are not its async loads in flight"
        else:
            own = {b for load in loads.values() for b in load.block_ids} if out.invalid_block_ids else set()
            stray = sorted(out.invalid_block_ids - own)
            hook, what = "get_block_ids_with_load_errors", f"blocks {stray[:8]}, which are not in its loads in flight"
        if not stray:
            return True
        self._fail(name, hook, BadHookAnswer(f"reported {what} ({len(stray)} in all); its loads are recomputed"))
        return False

    def _settle_loads(self, name: str, out: KVConnectorOutput, failed: bool, update: StepUpdate) -> None:
        """Sync loads end with their step, async ones when reported.

        A load fails (its blocks are recomputed) when its metadata never went
        out (``build_connector_meta`` failed), the worker side raised or the
        report was bad (``failed``).
        """
        loads = self._loads[name]
        for req_id, load in list(loads.items()):
            if failed or not load.sent:
                update.invalid_block_ids.update(load.block_ids)
                if load.is_async and load.sent:  # its worker may still report it: not a stray report then
                    self._abandoned[name][req_id] = self._step
            elif load.is_async and req_id not in out.finished_recving:
                continue  # still loading
            del loads[req_id]
            if load.is_async:
                update.finished_recving.add(req_id)

    def _settle_sends(self, name: str, out: KVConnectorOutput, failed: bool, update: StepUpdate) -> None:
        """Free delayed blocks once every connector that delayed them is done.

        A worker side that raised is presumed to have lost its transfers: the
        frees it was delaying are released rather than leaked. So are those
        it has not reported within ``stall_steps`` steps (and it is failed):
        held blocks would otherwise starve the engine for good. A report of a
        send it never delayed is ignored with a warning (an abort may have
        given up on it).
        """
        for req_id in out.finished_sending:
            if name not in self._sending.get(req_id, ()):
                logger.warning("connector %r reported an unknown send as finished: %r (ignored)", name, req_id)
        stalled = []
        for req_id, waiting in list(self._sending.items()):
            if failed or req_id in out.finished_sending:
                waiting.discard(name)
            elif name in waiting and self._step - self._send_steps.get(req_id, self._step) > self.stall_steps:
                waiting.discard(name)
                stalled.append(req_id)
            if not waiting:
                del self._sending[req_id]
                self._send_steps.pop(req_id, None)
                update.finished_sending.add(req_id)
        if stalled:
            self._fail(
                name,
                "get_finished",
                BadHookAnswer(
                    f"did not report the delayed frees of {stalled[:8]} in finished_sending within "
                    f"{self.stall_steps} steps (stall_steps); their blocks are released"
                ),
            )

    def abandon_send(self, req_id: str) -> None:
        """Stop waiting for connectors to finish sending ``req_id`` (it was aborted)."""
        self._sending.pop(req_id, None)
        self._send_steps.pop(req_id, None)

    def pending_loads(self) -> dict[str, set[str]]:
        """Requests with a load in flight, per connector."""
        return {name: set(loads) for name, loads in self._loads.items()}

    def pending_load_blocks(self) -> dict[str, set[int]]:
        """Blocks of the loads in flight, per connector: the only ones it may report as failed to load."""
        return {name: {b for load in loads.values() for b in load.block_ids} for name, loads in self._loads.items()}

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """A connector that fails here is disabled: every step reports it failed (loads recompute).

        A :class:`~kvconn.errors.ConnectorConfigError` is raised instead: the
        config does not fit this engine (a pool smaller than one block, say),
        which only the operator can fix; running without the connector would hide it.
        """
        for name, call in self._impls["register_kv_caches"]:
            try:
                call(kv_caches)
            except ConnectorConfigError:
                raise
            except Exception as exc:
                self._fail(name, "register_kv_caches", exc)
        self._disabled = set(self._failed_this_step)

    def bind_connector_metadata(self, metadata: Mapping[str, KVConnectorMetadata] | None) -> None:
        """This step's metadata; a connector without an entry sits the step out."""
        self._metadata = dict(metadata or {})
        if self._layered:
            self._plan_layers()

    def _plan_layers(self) -> None:
        """Decide once per step (and again when a connector fails) who takes part in the per-layer hooks.

        They run layers x connectors times a step, so each call is a plain loop
        over a ready list: connectors that have not failed and, for the hooks
        taking it, have metadata this step, paired with that metadata.
        """
        failed, metadata = self._failed_this_step, self._metadata

        def with_metadata(hook: str) -> list[tuple[str, Callable[..., Any], KVConnectorMetadata]]:
            return [(n, c, metadata[n]) for n, c in self._impls.get(hook, ()) if n not in failed and n in metadata]

        self._kv_loads = with_metadata("start_load_kv")
        self._layer_saves = with_metadata("save_kv_layer")
        self._layer_waits = [(n, c) for n, c in self._impls.get("wait_for_layer_load", ()) if n not in failed]

    # The per-layer hooks run layers x connectors times a step: each loop is timed as a whole (two clock
    # reads per layer, whatever the number of connectors), and a slow call is put down to every connector
    # that took part in it. start_load_kv runs once a step and is timed per connector.

    def start_load_kv(self) -> None:
        for name, call, metadata in self._kv_loads:
            started = perf_counter()
            try:
                call(metadata)
            except Exception as exc:
                self._fail(name, "start_load_kv", exc)
            if (elapsed := perf_counter() - started) > self.hook_budget_s:
                self._slow(name, "start_load_kv", elapsed)
            elif self._slow_in_a_row:
                self._in_budget(name, "start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        started = perf_counter()
        for name, call in self._layer_waits:
            try:
                call(layer_name)
            except Exception as exc:
                self._fail(name, "wait_for_layer_load", exc)
        if (elapsed := perf_counter() - started) > self.hook_budget_s:
            self._slow_layer(self._layer_waits, "wait_for_layer_load", elapsed)
        elif self._slow_in_a_row:
            self._layer_in_budget(self._layer_waits, "wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        started = perf_counter()
        for name, call, metadata in self._layer_saves:
            try:
                call(layer_name, kv_layer, metadata)
            except Exception as exc:
                self._fail(name, "save_kv_layer", exc)
        if (elapsed := perf_counter() - started) > self.hook_budget_s:
            self._slow_layer(self._layer_saves, "save_kv_layer", elapsed)
        elif self._slow_in_a_row:
            self._layer_in_budget(self._layer_saves, "save_kv_layer")

    def _slow_layer(self, taking_part: Sequence[tuple[Any, ...]], hook: str, seconds: float) -> None:
        for entry in list(taking_part):  # a connector degraded here leaves the list (its layers are re-planned)
            self._slow(entry[0], hook, seconds)

    def _layer_in_budget(self, taking_part: Sequence[tuple[Any, ...]], hook: str) -> None:
        for entry in taking_part:
            self._in_budget(entry[0], hook)

    def wait_for_save(self) -> None:
        if self._impls["wait_for_save"]:
            self._notify("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> dict[str, KVConnectorOutput]:
        """Collect each connector's report for this step and end the step.

        A report of the wrong type (not sets of request ids, block ids and
        numeric stats) is a bad answer: that connector's step failed.
        """
        outputs = {name: KVConnectorOutput() for name in self.connectors}
        if self._reporting:
            for name, (sending, recving) in self._each("get_finished", (finished_req_ids,), _finished):
                outputs[name].finished_sending, outputs[name].finished_recving = sending, recving
            for name, errors in self._each("get_block_ids_with_load_errors", (), _block_ids):
                outputs[name].invalid_block_ids = errors
            for name, stats in self._each("get_kv_connector_stats", (), _stats):
                outputs[name].stats = stats
        for name in self._failed_this_step:
            outputs[name].failed = True
        self._failed_this_step = set(self._disabled)
        self._metadata = {}
        if self._layered:
            self._plan_layers()
        return outputs

    # ---------------------------------------------------------------------- both

    def num_tracked_requests(self) -> dict[str, int]:
        """Per connector, how many requests it still tracks (if it says; an answer that is not an int >= 0 is bad)."""
        return {name: n for name, n in self._each("get_num_tracked_requests", (), _count) if n is not None}

    def shutdown(self) -> None:
        self._notify("shutdown")
