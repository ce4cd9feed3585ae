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
  error surfaces as :class:`~kvconn.errors.ConnectorError`.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pluggy

from .block_state import BlockIds, KVConnectorBlockState, block_ids_in_range
from .connector import KVConnectorRole
from .context import ConnectorContext
from .errors import ConnectorError, ConnectorLoadError
from .hookspecs import SCHEDULER_HOOKS, WORKER_HOOKS
from .manager import KVConnPluginManager
from .metadata import KVConnectorMetadata
from .outputs import KVConnectorOutput, SchedulerOutput
from .registry import connector_roles, instantiate_connector, load_connector_class
from .request import ConnectorRequest

__all__ = ["ConnectorHost", "LoadPlan", "StepUpdate"]

logger = logging.getLogger("kvconn.host")

OnError = Literal["degrade", "raise"]
#: (connector name, a callable taking the hook's arguments positionally, in spec order)
_Impl = tuple[str, Callable[..., Any]]


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


class ConnectorHost:
    """Runs connectors of one role for an engine.

    Args:
        connectors: ``{name: connector}`` or ``[(name, connector), ...]``, in
            priority order (the first with a hit loads).
        role: the side of the engine this host serves.
        context: the engine facts (block size is used to map loads to blocks).
        on_error: ``"degrade"`` (default) or ``"raise"``.
    """

    def __init__(
        self,
        connectors: Mapping[str, object] | Sequence[tuple[str, object]],
        *,
        role: KVConnectorRole | str,
        context: ConnectorContext | None = None,
        on_error: OnError = "degrade",
    ) -> None:
        if on_error not in ("degrade", "raise"):
            raise ValueError(f"on_error must be 'degrade' or 'raise', not {on_error!r}")
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
        # scheduler side: loads in flight per connector, frees delayed per request
        self._loads: dict[str, dict[str, _Load]] = {name: {} for name in self.connectors}
        self._sending: dict[str, set[str]] = {}
        self._failed_this_step: set[str] = set()
        # worker side: this step's metadata per connector; connectors whose
        # register_kv_caches failed hold no caches and sit out every step
        self._metadata: dict[str, KVConnectorMetadata] = {}
        self._disabled: set[str] = set()
        self._plan_layers()

    @classmethod
    def from_names(
        cls,
        names: str | Sequence[str],
        *,
        role: KVConnectorRole | str,
        config: Mapping[str, Any] | None = None,
        context: ConnectorContext | None = None,
        on_error: OnError = "degrade",
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
        return cls(loaded, role=role, context=ctx, on_error=on_error)

    def _register(self, name: str, connector: object) -> None:
        if name in self.connectors:
            raise ConnectorLoadError(f"connector {name!r} is given twice: each connector needs a distinct name")
        try:
            self._pm.register(connector, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise ConnectorLoadError(f"connector {name!r} has an invalid hook implementation: {exc}") from exc
        self.connectors[name] = connector
        self.metadata_types[name] = getattr(connector, "Metadata", KVConnectorMetadata)

    @property
    def names(self) -> list[str]:
        return list(self.connectors)

    @property
    def degraded_events(self) -> int:
        """How many hook calls failed and were degraded."""
        return sum(self.error_counts.values())

    # ------------------------------------------------------------------ calling
    # Every hook call goes through _each (or the per-layer loops below): one
    # ``try`` per connector, arguments passed positionally in spec order.

    def _fail(self, name: str, hook: str, exc: Exception) -> None:
        if self.on_error == "raise":
            raise ConnectorError(name, hook, exc) from exc
        key = (name, hook)
        if not self.error_counts[key]:
            logger.warning(
                "connector %r failed in %s; its work for this step is dropped (degraded): %s: %s",
                name, hook, type(exc).__name__, exc, exc_info=exc,
            )  # fmt: skip
        self.error_counts[key] += 1
        self._failed_this_step.add(name)
        if self.role is KVConnectorRole.WORKER:
            self._plan_layers()  # it sits out the rest of the step

    def _each(self, hook: str, args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
        """Call ``hook`` on every connector implementing it, in order; yield ``(name, result)`` of the successes.

        ``args`` are the spec's arguments in order, or a function of the
        connector's name returning them. On the worker, a connector that
        raised earlier in the step sits out the rest of it.
        """
        skip = self._failed_this_step if self.role is KVConnectorRole.WORKER else ()
        for name, call in self._impls[hook]:
            if name in skip:
                continue
            try:
                result = call(*(args(name) if callable(args) else args))
            except Exception as exc:
                self._fail(name, hook, exc)
            else:
                yield name, result

    def _notify(self, hook: str, args: tuple[Any, ...] | Callable[[str], tuple[Any, ...]] = ()) -> None:
        """Call ``hook`` on every connector for its side effects (``args`` as for :meth:`_each`)."""
        for _ in self._each(hook, args):
            pass

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> LoadPlan:
        """Ask each connector in order; the first that reports tokens loads."""
        for name, result in self._each("get_num_new_matched_tokens", (request, num_computed_tokens)):
            num_tokens, load_async = result if result is not None else (0, False)
            if num_tokens is None:
                return LoadPlan(None, False, name)
            if num_tokens > 0:
                return LoadPlan(num_tokens, bool(load_async), name)
        return NO_LOAD

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
        """Tell every connector; returns whether any delays freeing the blocks."""
        delayed = {
            name
            for name, result in self._each("request_finished", (request, block_ids))
            if (result[0] if isinstance(result, tuple) else result)
        }
        if delayed:
            self._sending[request.request_id] = delayed
        return bool(delayed)

    def update_connector_output(self, outputs: Mapping[str, KVConnectorOutput]) -> StepUpdate:
        """Hand each connector its worker report and merge what the engine must do."""
        update = StepUpdate()
        empty = KVConnectorOutput()
        self._notify("update_connector_output", lambda name: (outputs.get(name, empty),))
        for name in self.connectors:
            out = outputs.get(name, empty)
            update.stats.update(out.stats)
            self._settle_loads(name, out, update)
            self._settle_sends(name, out, update)
            update.invalid_block_ids |= out.invalid_block_ids
        return update

    def _settle_loads(self, name: str, out: KVConnectorOutput, update: StepUpdate) -> None:
        """Sync loads end with their step, async ones when reported.

        A load fails (its blocks are recomputed) when its metadata never went
        out (``build_connector_meta`` failed) or the worker side raised.
        """
        loads = self._loads[name]
        for req_id in out.finished_recving - loads.keys():
            logger.warning("connector %r reported an unknown load as finished: %r (ignored)", name, req_id)
        for req_id, load in list(loads.items()):
            if out.failed or not load.sent:
                update.invalid_block_ids.update(load.block_ids)
            elif load.is_async and req_id not in out.finished_recving:
                continue  # still loading
            del loads[req_id]
            if load.is_async:
                update.finished_recving.add(req_id)

    def _settle_sends(self, name: str, out: KVConnectorOutput, update: StepUpdate) -> None:
        """Free delayed blocks once every connector that delayed them is done.

        A worker side that raised is presumed to have lost its transfers: the
        frees it was delaying are released rather than leaked.
        """
        for req_id in out.finished_sending:
            if name not in self._sending.get(req_id, ()):
                logger.warning("connector %r reported an unknown send as finished: %r (ignored)", name, req_id)
        for req_id, waiting in list(self._sending.items()):
            if out.failed or req_id in out.finished_sending:
                waiting.discard(name)
            if not waiting:
                del self._sending[req_id]
                update.finished_sending.add(req_id)

    def abandon_send(self, req_id: str) -> None:
        """Stop waiting for connectors to finish sending ``req_id`` (it was aborted)."""
        self._sending.pop(req_id, None)

    def pending_loads(self) -> dict[str, set[str]]:
        """Requests with a load in flight, per connector."""
        return {name: set(loads) for name, loads in self._loads.items()}

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """A connector that fails here is disabled: every step reports it failed (loads recompute)."""
        self._notify("register_kv_caches", (kv_caches,))
        self._disabled = set(self._failed_this_step)

    def bind_connector_metadata(self, metadata: Mapping[str, KVConnectorMetadata] | None) -> None:
        """This step's metadata; a connector without an entry sits the step out."""
        self._metadata = dict(metadata or {})
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

    def start_load_kv(self) -> None:
        for name, call, metadata in self._kv_loads:
            try:
                call(metadata)
            except Exception as exc:
                self._fail(name, "start_load_kv", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for name, call in self._layer_waits:
            try:
                call(layer_name)
            except Exception as exc:
                self._fail(name, "wait_for_layer_load", exc)

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        for name, call, metadata in self._layer_saves:
            try:
                call(layer_name, kv_layer, metadata)
            except Exception as exc:
                self._fail(name, "save_kv_layer", exc)

    def wait_for_save(self) -> None:
        self._notify("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> dict[str, KVConnectorOutput]:
        """Collect each connector's report for this step and end the step."""
        outputs = {name: KVConnectorOutput() for name in self.connectors}
        for name, result in self._each("get_finished", (finished_req_ids,)):
            sending, recving = result if result is not None else (None, None)
            outputs[name].finished_sending = set(sending or ())
            outputs[name].finished_recving = set(recving or ())
        for name, errors in self._each("get_block_ids_with_load_errors", ()):
            outputs[name].invalid_block_ids = set(errors or ())
        for name, stats in self._each("get_kv_connector_stats", ()):
            outputs[name].stats = dict(stats or {})
        for name in self._failed_this_step:
            outputs[name].failed = True
        self._failed_this_step = set(self._disabled)
        self._metadata = {}
        self._plan_layers()
        return outputs

    # ---------------------------------------------------------------------- both

    def num_tracked_requests(self) -> dict[str, int]:
        """Per connector, how many requests it still tracks (if it says)."""
        return {name: int(n) for name, n in self._each("get_num_tracked_requests", ()) if n is not None}

    def shutdown(self) -> None:
        self._notify("shutdown")
