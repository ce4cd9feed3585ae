"""``KVConnVllmConnector``: kvconn connectors behind vLLM's ``KVConnectorBase_V1``.

One instance serves one vLLM role and owns a :class:`kvconn.ConnectorHost` of
that role, built from ``kv_transfer_config.kv_connector_extra_config``::

    {"kvconn_connector": "offload" | ["offload", "mooncake"],
     "kvconn_config": {...},            # one connector: its config; several: {name: config}
     "kvconn_on_error": "degrade"}      # or "raise"

Every call vLLM makes is forwarded to the host, with vLLM's types translated
at this boundary (:mod:`.translate`). What crosses processes is plain data:

* scheduler -> workers: :class:`KVConnVllmMetadata` (pickled by vLLM's
  ``MessageQueue``): each connector's metadata as msgpack bytes
  (:func:`kvconn.host.wire.encode_metadata`) and the blocks of the loads in flight;
  on an idle step (every connector's metadata its ``Metadata()`` default, no load
  in flight, no report awaited: most decode steps) a :data:`IdleStep` instead;
* workers -> scheduler: :class:`KVConnVllmWorkerMetadata` (vLLM's
  ``kv_connector_worker_meta``): one :class:`~.reports.WorkerReport` per worker.

Load failures reach vLLM as ``invalid_block_ids`` *in the step that ran on
them*, because vLLM handles invalid blocks before it calls
``update_connector_output``: the scheduler lists each connector's loads in the
metadata, and a worker whose connector raised, or got no metadata, reports
that connector's load blocks itself. vLLM then recomputes or fails the
request according to ``kv_load_failure_policy`` (use ``"recompute"``).

With several KV-cache groups, vLLM 0.33 takes no invalid blocks (block ids are
unique only within a group: ``Scheduler._handle_invalid_blocks`` raises) and
takes a failed load per request, in ``KVConnectorTransferResults.failed_recving``,
for async loads only (``Scheduler._handle_failed_recving`` acts on requests in
``WAITING_FOR_REMOTE_KVS``). So there every load is async to vLLM (a connector's
sync load still runs in the worker step its metadata reaches, and ends with it),
and a load that ended with a failed block is held back one step: the scheduler
lists it in ``failed_loads``, and the workers report it in ``failed_recving``
and ``finished_recving`` (both, as vLLM's ``KVOutputAggregator`` requires). vLLM
then recomputes the request from its first token (``_update_waiting_for_remote_kv``
frees its blocks and asks the connector again).
"""

from __future__ import annotations

import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # vLLM 0.29: failed loads are invalid blocks only, with any number of groups
    KVConnectorTransferResults = None
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconn import load_connector_class
from kvconn.block_state import KVConnectorBlockState, block_ids_in_range
from kvconn.connector import KVConnectorRole as KVConnRole
from kvconn.errors import ConnectorConfigError, ConnectorNotFoundError, KVConnError, WireError
from kvconn.host import NO_LOAD, ConnectorHost, LoadPlan, LoadSpec, SchedulerHost, StepUpdate, WorkerHost
from kvconn.host.wire import decode_metadata, encode_metadata
from kvconn.introspection import build_config, connector_roles, hook_object
from kvconn.metadata import KVConnectorMetadata as KVConnMetadata
from kvconn.outputs import KVConnectorOutput

from . import EXTRA_CONFIG_KEYS, route_logs_to_vllm
from .reports import ReportCollector, WorkerReport, encode_report
from .tables import TableTracker
from .telemetry import (
    GAUGES,
    SECONDS,
    ConnectorTelemetry,
    aggregate_stats,
    hit_source,
    prom_metrics_class,
    reduce_stats,
    to_vllm_events,
)
from .translate import (
    VllmRequestView,
    check_kv_caches,
    context_from_vllm,
    to_block_ids,
    translate_scheduler_output,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a vLLM that never runs its hybrid KV cache manager with a connector

    class SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for vLLM's marker of connectors that handle several KV-cache groups."""


__all__ = ["IdleStep", "KVConnVllmConnector", "KVConnVllmMetadata", "KVConnVllmStats", "KVConnVllmWorkerMetadata"]

logger = logging.getLogger("kvconn.vllm")

# vLLM versions without worker metadata only see get_finished's merged sets.
_HAS_WORKER_META = hasattr(KVConnectorBase_V1, "build_connector_worker_meta")


@dataclass
class KVConnVllmMetadata(KVConnectorMetadata):
    """What the scheduler sends the workers each step (plain data only).

    ``connectors``: each connector's metadata, msgpack-encoded.
    ``loads``: per connector, ``req_id -> (blocks, is_async)`` of its loads in flight.
    ``failed_loads``: loads vLLM planned that no connector will do (the loader
    failed while committing them): reported invalid by the workers.
    ``dropped``: connectors whose metadata failed this step: their loads fail.
    ``report``: the workers report this step even with nothing to say (a
    transfer is in flight, whose stall bound counts the reports).
    """

    connectors: dict[str, bytes] = field(default_factory=dict)
    loads: dict[str, dict[str, LoadSpec]] = field(default_factory=dict)
    failed_loads: dict[str, LoadSpec] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    report: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields, in order (vLLM pickles it every step: faster than a dataclass's state dict)."""
        return (KVConnVllmMetadata, (self.connectors, self.loads, self.failed_loads, self.dropped, self.report))


#: What the scheduler sends on an idle step: the connectors whose metadata is their ``Metadata()`` default.
#: A builtin tuple of names, not a class instance: vLLM pickles the metadata every step, and a class costs a
#: lookup of its module each way (~2 us a step, the largest share of an idle step's cost). vLLM only hands
#: the metadata from its scheduler to its workers' ``bind_connector_metadata``; it never reads its type.
IdleStep = tuple[str, ...]

#: A worker's metadata between steps, and on an idle step (read, never changed).
_UNBOUND = KVConnVllmMetadata()
#: No request ids, no block ids (shared, never changed: what a step without failed loads has).
_NO_IDS: frozenset[str] = frozenset()
_NO_BLOCKS: frozenset[int] = frozenset()


@dataclass
class KVConnVllmWorkerMetadata(KVConnectorWorkerMetadata):
    """The workers' per-connector reports of one step (see :mod:`.reports`)."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnVllmWorkerMetadata) -> KVConnVllmWorkerMetadata:
        return KVConnVllmWorkerMetadata(self.reports + other.reports)


@dataclass
class KVConnVllmStats(KVConnectorStats):
    """Counters as ``{"<connector>.<counter>": value}``, summed over workers and steps; gauges and step seconds.

    The layout is :mod:`.telemetry`'s (gauges under ``"gauges"``, the seconds of
    each step's loads and saves under ``"seconds"``).
    """

    def aggregate(self, other: KVConnectorStats) -> KVConnVllmStats:
        return KVConnVllmStats(data=aggregate_stats(dict(self.data), other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        return not self.data


def _host_options(extra: dict[str, Any]) -> tuple[str | list[str], Any, dict[str, Any]]:
    """The connector name(s), their config, and the host's own options (``kvconn_on_error`` ...).

    A ``kvconn_`` key the adapter does not read is an error: a misspelt one
    would otherwise leave the engine on defaults without a word.
    """
    unknown = sorted(k for k in extra if k.startswith("kvconn_") and k not in EXTRA_CONFIG_KEYS)
    if unknown:
        hints = [
            f"{key!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(key, EXTRA_CONFIG_KEYS, 1))
            else repr(key)
            for key in unknown
        ]
        raise ConnectorConfigError(
            f"kv_connector_extra_config has unknown kvconn key(s): {', '.join(hints)}; "
            f"the keys kvconn reads are {', '.join(EXTRA_CONFIG_KEYS)}"
        )
    names = extra.get("kvconn_connector")
    if not names or not isinstance(names, (str, list)) or not all(isinstance(n, str) for n in names):
        raise ConnectorConfigError(
            "kv_connector_extra_config must name the kvconn connector(s) to run, e.g. "
            '{"kvconn_connector": "offload"} or {"kvconn_connector": ["offload", "mooncake"]}; '
            f"got kvconn_connector={names!r} (see `kvconn list` for the installed ones)"
        )
    options = {key.removeprefix("kvconn_"): extra[key] for key in EXTRA_CONFIG_KEYS[2:] if key in extra}
    if options.get("on_error", "degrade") not in ("degrade", "raise"):
        raise ConnectorConfigError(f"kvconn_on_error must be 'degrade' or 'raise', not {options['on_error']!r}")
    return names, extra.get("kvconn_config"), options


def _per_connector(names: str | list[str], config: Any) -> dict[str, Any]:
    """Each connector's config (``kvconn_config`` is the one connector's, or ``{name: config}`` for several)."""
    name_list = [names] if isinstance(names, str) else names
    configs = {name_list[0]: config} if len(name_list) == 1 else (config if isinstance(config, dict) else {})
    return {name: configs.get(name) for name in name_list}


def _validate_hint(names: str | list[str], config: Any) -> str:
    """The command that finds a config error in a second, before a launch (one per connector)."""
    commands = [
        f"kvconn validate {name}" + (f" --config '{json.dumps(one)}'" if one else "")
        for name, one in _per_connector(names, config).items()
    ]
    return "; check a kv_connector_extra_config before a launch with: " + " && ".join(commands)


def check_extra_config(extra: dict[str, Any]) -> None:
    """Everything about ``kv_connector_extra_config`` that needs no engine: keys, connector names, their configs.

    Raises a :class:`~kvconn.errors.KVConnError` whose message names what is wrong and the
    ``kvconn validate`` command to check a fix, as the connector's own start-up would, later.
    """
    names, config, _ = _host_options(extra)
    try:
        for name, one in _per_connector(names, config).items():
            build_config(load_connector_class(name), one, name=name)
    except KVConnError as exc:
        raise type(exc)(f"{exc}{_validate_hint(names, config)}") from None


#: vLLM executors that run the workers in the scheduler's process.
_IN_PROCESS_EXECUTORS = frozenset({"uni", "external_launcher"})


def _refuse_split_in_process_state(host: ConnectorHost, vllm_config: Any) -> None:
    """Refuse connectors whose two sides share memory when vLLM runs its workers in other processes.

    Run anyway, such a connector's scheduler never sees what its workers store:
    no hit, ever, and no error. Refusing at start-up says what to change.
    """
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in _IN_PROCESS_EXECUTORS:
        return
    split = [name for name, c in host.connectors.items() if getattr(c, "in_process_state", False)]
    if not split:
        return
    host.shutdown()
    raise ConnectorConfigError(
        f"kvconn connector(s) {split} keep their state in one process (in_process_state, e.g. mooncake's embedded "
        f"store), but this vLLM runs its workers in other processes (distributed_executor_backend={backend!r}), "
        "so the scheduler would never see what the workers store: give the connector a shared backend (mooncake: "
        "set master_server_address or MOONCAKE_MASTER), or run vLLM in one process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1)"
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):
        return 0  # no distributed state (single process, tests)


def _stable_default(name: str, metadata_type: type[KVConnMetadata]) -> tuple[KVConnMetadata, bytes] | None:
    """``Metadata()`` and its encoding, if it has defaults for every field and encodes the same each time."""
    try:
        default = metadata_type()
        blob = encode_metadata(name, default)
        again = encode_metadata(name, metadata_type())  # a worker builds its own default
    except (TypeError, KVConnError):  # a required field
        return None
    return (default, blob) if blob == again else None


def _idle_step(
    host: ConnectorHost, builders: list[str]
) -> tuple[IdleStep | None, dict[str, tuple[KVConnMetadata, bytes]]]:
    """The scheduler's :data:`IdleStep`, and each builder's default metadata with its encoding.

    ``None`` when a builder's ``Metadata`` has no stable default: every step then sends its metadata.
    """
    found = {name: _stable_default(name, host.metadata_types[name]) for name in builders}
    defaults = {name: pair for name, pair in found.items() if pair is not None}
    return (tuple(builders) if len(defaults) == len(found) else None), defaults


def _failed_loads(loads: dict[str, LoadSpec]) -> tuple[set[str], set[int]]:
    """The async ones of loads that no connector will do, and all their blocks (reported invalid)."""
    return {r for r, (_, is_async) in loads.items() if is_async}, {b for blocks, _ in loads.values() for b in blocks}


class KVConnVllmConnector(KVConnectorBase_V1, SupportsHMA):
    """Hosts kvconn connectors for one vLLM role; see the module docstring.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): kvconn
    connectors always see one table per KV-cache group, with vLLM's null
    block (id 0, as kvconn's ``NULL_BLOCK_ID``) where a sliding window freed
    a block.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs_to_vllm()
        names, config, options = _host_options(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        is_worker = role == KVConnectorRole.WORKER
        self.context = context_from_vllm(vllm_config, kv_cache_config, tp_rank=_tp_rank() if is_worker else 0)
        try:
            self.host = ConnectorHost.from_names(
                names,
                role=KVConnRole.WORKER if is_worker else KVConnRole.SCHEDULER,
                config=config,
                context=self.context,
                **options,
            )
        except (ConnectorConfigError, ConnectorNotFoundError) as exc:
            raise type(exc)(f"{exc}{_validate_hint(names, config)}") from None
        # The same host as its role's class, for that role's calls (the other role's attribute is never set).
        if isinstance(self.host, WorkerHost):
            self._worker_host = self.host
        elif isinstance(self.host, SchedulerHost):
            self._scheduler_host = self.host
        _refuse_split_in_process_state(self.host, vllm_config)
        route_logs_to_vllm({type(c).__module__.partition(".")[0] for c in self.host.connectors.values()})
        self._telemetry = {n: ConnectorTelemetry.of(type(c)) for n, c in self.host.connectors.items()}
        # Events only when vLLM publishes them: a connector records none until its take_events is first called,
        # so it is called once here, before any block is stored.
        events_config = getattr(vllm_config, "kv_events_config", None)
        self._publishes_events = bool(getattr(events_config, "enable_kv_cache_events", False))
        if self._publishes_events:
            self.take_events()
        # scheduler side
        self._step = 0
        self._plans: dict[str, tuple[LoadPlan, int]] = {}
        # The loads in flight are the host's record (SchedulerHost.loads_in_flight). These are the adapter's own:
        # loads vLLM planned that no connector does (the loader failed committing them), and, with several groups,
        # loads that ended with a failed block; the host is done with both, vLLM is not until the workers report
        # them (invalid blocks, or failed_recving), so they go out once in the next step's metadata.
        self._failed_loads: dict[str, LoadSpec] = {}
        self._tracker: TableTracker | None = None
        self._sliding = any(g.sliding_window is not None for g in self.context.kv_cache_groups)
        # several groups under a vLLM with failed_recving: failed loads go per request (see the module docstring)
        self._per_request = KVConnectorTransferResults is not None and len(self.context.kv_cache_groups) > 1
        # Metadata goes to workers only for connectors that run there (scheduler-only ones are left out).
        self._sent = {n for n, c in self.host.connectors.items() if KVConnRole.WORKER in connector_roles(type(c))}
        self._builders = [
            n
            for n, c in self.host.connectors.items()
            if n in self._sent and hasattr(hook_object(c), "build_connector_meta")
        ]
        self._idle, self._defaults = _idle_step(self.host, self._builders)
        self._collector = ReportCollector(self.host.names, int(vllm_config.parallel_config.world_size))
        # worker side: metadata is decoded only for connectors with a worker hook that takes it
        self._readers = set(self.host.implementers("start_load_kv") + self.host.implementers("save_kv_layer"))
        self._bound = _UNBOUND
        self._undecoded: list[str] = []
        self._report: WorkerReport | None = None
        # Kept between a step's end and vLLM's calls for them: read-only (replaced, never changed in place).
        self._invalid: set[int] | frozenset[int] = _NO_BLOCKS
        self._failed_recving: set[str] | frozenset[str] = _NO_IDS
        # Stats for vLLM (KVConnVllmStats' layout), and what they are gathered from off the step path: the
        # scheduler's lookups (loader, blocks missed, blocks hit) and whether anything happened since the last
        # gathering (news: a lookup, a worker report); the host's errors counted so far.
        self._stats: dict[str, Any] = {}
        self._lookups: list[tuple[str | None, int, int]] = []
        self._news = False
        self._errors_seen: dict[tuple[str, str], int] = {}
        self._loader: tuple[str, str | None] = ("", None)  # the last request update_state_after_alloc saw
        self._lookup_names = (
            self.host.implementers("get_num_new_matched_tokens") if isinstance(self.host, SchedulerHost) else []
        )
        self._scheduler_stats: list[tuple[str, Callable[[], Any]]] = [
            (n, fn)
            for n, c in self.host.connectors.items()
            if isinstance(self.host, SchedulerHost) and callable(fn := getattr(hook_object(c), "scheduler_stats", None))
        ]
        self._timed: list[str] = []  # the connectors with work in this worker step: its seconds are theirs
        self._saved = True  # no step open until metadata is bound
        self._late_layer_logged = False

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._scheduler_host.get_num_new_matched_tokens(VllmRequestView(request), num_computed_tokens)
        num_tokens = plan.num_tokens
        if num_tokens is None:
            return None, False
        if num_tokens and not plan.load_async:
            # After a synchronous load vLLM must have a token left to compute (it asserts num_new_tokens > 0):
            # whole blocks that leave the last token, as kvconn's reference engine cuts every hit.
            size = self.context.block_size
            cut = max(0, (request.num_tokens - 1) // size * size - num_computed_tokens)
            if num_tokens > cut:
                num_tokens, plan = cut, LoadPlan(cut, False, plan.connector)
        self._plans[request.request_id] = (plan, num_computed_tokens)
        return num_tokens, (plan.load_async or self._per_request) and num_tokens > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Commit the planned load; vLLM's external tokens follow the block-aligned local hit."""
        block_ids = to_block_ids(blocks.get_block_ids())
        plan, local_hit = self._plans.pop(request.request_id, (NO_LOAD, request.num_computed_tokens))
        if num_external_tokens:
            plan = LoadPlan(num_external_tokens, plan.load_async, plan.connector)
        else:
            plan, local_hit = NO_LOAD, request.num_computed_tokens
        view = VllmRequestView(request, num_computed_tokens=local_hit)
        loading = self._scheduler_host.update_state_after_alloc(view, block_ids, plan)
        self._loader = (request.request_id, plan.connector if num_external_tokens else None)
        if self._lookup_names:  # counted when stats are gathered: a lookup here costs one append
            size = self.context.block_size
            missable = request.num_tokens // size - local_hit // size  # full blocks past vLLM's own hit
            self._lookups.append((self._loader[1], missable, num_external_tokens // size))
            self._news = True
        if num_external_tokens and not loading:  # the host records a load that is on; this one no connector does
            end = local_hit + num_external_tokens
            blocks_to_load = block_ids_in_range(block_ids, local_hit, end, self.context.block_size)
            self._failed_loads[request.request_id] = (blocks_to_load, plan.load_async or self._per_request)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """The tier of the connector loading ``request``'s external tokens (vLLM's by-source cached-token counters).

        vLLM asks right after ``update_state_after_alloc`` for the same request.
        One connector loads a request's whole external hit (the host's first
        hit wins), so a request has one source; with several connectors each
        request's is its loader's (offload: host, a remote store:
        ``external_unspecified``, vLLM's source for remote stores).
        """
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if not num_external_tokens:
            return {}
        req_id, loader = self._loader
        tier = self._telemetry[loader].tier if loader is not None and req_id == request.request_id else None
        return {CacheHitSource(hit_source(tier)): num_external_tokens}

    def take_events(self) -> Any:
        """The blocks kvconn's connectors stored and dropped since the last step, as vLLM's KV-cache events.

        vLLM calls this every step and publishes what it returns with its own
        events (``kv_events_config``); with its publisher off, connectors are
        never asked, so they record nothing.
        """
        if not self._publishes_events:
            return ()
        events: list[Any] = []
        for name, connector in self.host.connectors.items() if isinstance(self.host, SchedulerHost) else ():
            take = getattr(hook_object(connector), "take_events", None)
            if take is None:
                continue
            try:
                events += to_vllm_events(take(), self._telemetry[name].tier)
            except Exception:  # telemetry never stops the engine
                logger.exception("kvconn connector %r: its KV-cache events were dropped", name)
        return events

    def build_connector_meta(self, scheduler_output: Any) -> KVConnVllmMetadata | IdleStep:
        self._step += 1
        output = translate_scheduler_output(scheduler_output, self._step)
        host = self._scheduler_host
        metadata = host.build_connector_meta(output, self._block_state(scheduler_output, output))
        encoded: dict[str, bytes] = {}
        idle, defaults = self._idle, self._defaults
        for name, meta in metadata.items():
            if name not in self._sent:
                continue
            if idle is not None and meta == defaults[name][0]:  # what its workers decode: nothing to encode
                encoded[name] = defaults[name][1]
                continue
            try:
                blob = encoded[name] = encode_metadata(name, meta)
            except KVConnError as exc:  # its workers get no metadata and fail its loads
                logger.warning("kvconn connector %r: metadata dropped this step: %s", name, exc)
                continue
            if idle is not None and blob != defaults[name][1]:
                idle = None
        # encoded holds only builders' metadata: one missing was dropped
        dropped = [n for n in self._builders if n not in encoded] if len(encoded) < len(self._builders) else []
        if idle is not None and not dropped and not self._failed_loads and not host.awaits_reports:
            return idle  # nothing in flight: nothing for the workers to fail or report either
        failed: dict[str, LoadSpec] = {}
        if self._failed_loads:  # sent once, in a dict of the metadata's own
            failed, self._failed_loads = self._failed_loads, failed
        loads = host.loads_in_flight(built_last=True)  # sync loads run in this step only: sent once too
        return KVConnVllmMetadata(encoded, loads, failed, dropped, report=host.awaits_reports)

    def sent_metadata(self, sent: KVConnVllmMetadata | IdleStep, name: str) -> bytes | None:
        """Connector ``name``'s metadata, encoded, in what :meth:`build_connector_meta` returned (``None``: none sent).

        On an idle step, the encoding of its ``Metadata()`` default: what its workers decode. For tools that
        check what a connector sent (``kvconn validate --engine vllm``).
        """
        if isinstance(sent, tuple):
            return self._defaults[name][1] if name in sent else None
        return sent.connectors.get(name)

    def _block_state(self, scheduler_output: Any, output: Any) -> KVConnectorBlockState:
        """vLLM's lazy block state (0.30+), or tables tracked from the outputs.

        Tracked: vLLM without a block state, and vLLM 0.29, whose block state is a dict of only the requests
        that got new blocks this step (``block_ids``): its tables are vLLM's own and are used, the other
        scheduled requests' (the block-fill step's) come from the tracker.
        """
        state: Any = getattr(scheduler_output, "kv_connector_block_state", None)
        if self._tracker is None and hasattr(state, "req_ids"):
            # vLLM builds the offered set and the hand-offs afresh each step for the connector and drops them after
            # build_connector_meta: they are wrapped, not copied.
            return KVConnectorBlockState(
                state.req_ids, state.resolve_block_ids, getattr(state, "boundary_state_offloads", None)
            )
        snapshot: dict[str, Any] | None = None
        if state is not None and not hasattr(state, "req_ids"):
            snapshot, state = dict(state.block_ids), None
        if self._tracker is None:
            if self._sliding:
                logger.error(
                    "this vLLM sends no kv_connector_block_state and the model has sliding-window KV-cache groups, "
                    "whose tables cannot be tracked safely: connectors are offered no tables, so they save nothing "
                    "(loads still work); use a vLLM with the lazy block state to save"
                )
            elif self._step > 1:
                logger.error("vLLM stopped sending kv_connector_block_state mid-run; tracking tables from now on")
            elif snapshot is not None:
                logger.info(
                    "this vLLM's kv_connector_block_state holds only the requests that got new blocks: the other "
                    "scheduled requests' tables are tracked from scheduler outputs"
                )
            else:
                logger.info("this vLLM sends no kv_connector_block_state: tables are tracked from scheduler outputs")
            self._tracker = TableTracker()
        self._tracker.update(output)
        if self._sliding:  # only vLLM's own tables are safe
            return TableTracker.snapshot_state(snapshot or {})
        return self._tracker.block_state(output, snapshot)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with one KV-cache group (its hybrid manager off)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: the request's table in every group."""
        self._plans.pop(request.request_id, None)
        return self._scheduler_host.request_finished(VllmRequestView(request), to_block_ids(block_ids)), None

    def update_connector_output(self, connector_output: Any) -> None:
        """Hand each connector its report, then make vLLM act on the host's merged decision.

        vLLM reads ``finished_sending`` / ``finished_recving`` from this same
        object right after this call, so they are replaced in place by what
        the host decided (e.g. a free delayed by two connectors waits for both).
        """
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if worker_meta is None and _HAS_WORKER_META and self._scheduler_host.count_quiet_step():
            connector_output.finished_sending = connector_output.finished_recving = None  # no worker had news
            return
        failed_recving: set[str] | frozenset[str]
        if isinstance(worker_meta, KVConnVllmWorkerMetadata):
            outputs, failed_recving = self._collector.collect(worker_meta.reports)
        elif worker_meta is None and _HAS_WORKER_META:  # no worker had anything to report
            outputs, failed_recving = {}, _NO_IDS
        else:
            outputs, failed_recving = self._attribute(connector_output)
        host = self._scheduler_host
        if outputs:
            self._news = self._news or bool(self._scheduler_stats)  # a report may have changed their levels
            if any(out.failed or out.invalid_block_ids for out in outputs.values()):
                self._count_failed_loads(outputs)
        in_flight = host.loads_in_flight() if self._per_request else None  # before the host settles them
        update = host.update_connector_output(outputs)
        finished = self._hold_failed_loads(in_flight, update) if in_flight else update.finished_recving
        connector_output.finished_sending = update.finished_sending or None
        connector_output.finished_recving = (finished | failed_recving) or None

    def _count_failed_loads(self, outputs: dict[str, KVConnectorOutput]) -> None:
        """Count the loads in flight that these reports fail: a failed connector's all, else those with a bad block."""
        for name, loads in self._scheduler_host.loads_in_flight().items():
            out = outputs.get(name)
            if out is not None:
                failed = sum(out.failed or not out.invalid_block_ids.isdisjoint(blocks) for blocks, _ in loads.values())
                self._add_stat(f"{name}.failed_loads", failed)

    def _hold_failed_loads(self, in_flight: dict[str, dict[str, LoadSpec]], update: StepUpdate) -> set[str]:
        """Several groups: the loads that ended this update are finished for vLLM, but those with a failed block.

        ``in_flight`` is the host's loads before this update: its sync loads
        (async to vLLM) all end with it, its async ones if the update
        finished them. Those with a failed block are failed loads for the
        next step (the workers report them in ``failed_recving``, which vLLM
        reads before this call). A block id names a block only within its
        group, so a load holding the id of a failed block in any group fails:
        a recompute, never wrong KV.
        """
        ended = {
            req_id: blocks
            for loads in in_flight.values()
            for req_id, (blocks, is_async) in loads.items()
            if not is_async or req_id in update.finished_recving
        }
        failed = {r: (blocks, True) for r, blocks in ended.items() if not update.invalid_block_ids.isdisjoint(blocks)}
        self._failed_loads.update(failed)
        return (update.finished_recving | ended.keys()) - failed.keys()

    def _attribute(self, connector_output: Any) -> tuple[dict[str, KVConnectorOutput], set[str]]:
        """Without worker reports: vLLM's merged sets, each connector given what is its own.

        A finished load goes to the connector it is in flight with, and an
        invalid block to the connector whose load holds it: the host fails a
        connector that reports another's. Ids no connector has in flight are
        loads the scheduler failed itself (returned apart, as the workers'
        reports do). Finished sends go to every connector: a free waits for all
        that delayed it.
        """
        sending = set(connector_output.finished_sending or ())
        recving = set(connector_output.finished_recving or ())
        invalid = set(connector_output.invalid_block_ids or ())
        loads, blocks = self._scheduler_host.pending_loads(), self._scheduler_host.pending_load_blocks()
        outputs = {
            name: KVConnectorOutput(
                finished_sending=set(sending),
                finished_recving=recving & loads.get(name, set()),
                invalid_block_ids=invalid & blocks.get(name, set()),
            )
            for name in self.host.names
        }
        return outputs, recving - {r for ids in loads.values() for r in ids}

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_host.register_kv_caches(check_kv_caches(kv_caches, self.context))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Begin the step, and start its loads here: kvconn's worker step contract.

        vLLM calls its own ``start_load_kv`` before the forward only when the
        step has synchronous loads, and otherwise after it, after every
        ``save_kv_layer``. kvconn guarantees plugins ``start_load_kv`` first
        (:mod:`kvconn.hookspecs`), so the step starts as soon as its metadata
        is bound, before any layer, whatever order vLLM uses.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._undecoded:
            self._undecoded = []
        if isinstance(connector_metadata, tuple):  # an idle step: the named connectors' metadata is the default
            self._bound = _UNBOUND
            types = self.host.metadata_types
            self._begin_step({n: types[n]() for n in connector_metadata if n in self._readers} if self._readers else {})
            return
        self._bound = connector_metadata if isinstance(connector_metadata, KVConnVllmMetadata) else _UNBOUND
        self._timed = list(self._bound.connectors)  # a step with work: its loads and saves are timed
        decoded: dict[str, KVConnMetadata] = {}
        for name, blob in self._bound.connectors.items() if self._readers else ():
            if name not in self._readers:
                continue
            try:
                decoded[name] = decode_metadata(name, blob, self.host.metadata_types)
            except WireError as exc:
                logger.warning("%s; it sits this step out on this worker", exc)
                self._undecoded.append(name)
        self._begin_step(decoded)

    def _begin_step(self, metadata: dict[str, KVConnMetadata]) -> None:
        self._worker_host.bind_connector_metadata(metadata)
        self._saved = False
        if not self._bound.loads:
            self._worker_host.start_load_kv()
            return
        started = perf_counter()
        self._worker_host.start_load_kv()
        self._observe_seconds(list(self._bound.loads), "load", perf_counter() - started)

    def _observe_seconds(self, names: list[str], what: str, seconds: float) -> None:
        """One step's seconds in loads or saves, for each connector with work in it (the calls are the host's)."""
        observed = self._stats.setdefault(SECONDS, {})
        for name in names:
            observed.setdefault(f"{name}.{what}", []).append(seconds)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to do: the step's loads started when its metadata was bound."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_host.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if self._saved:  # a layer after the step's wait_for_save (vLLM's draft model): outside the contract
            if not self._late_layer_logged:
                self._late_layer_logged = True
                logger.warning(
                    "vLLM saved layer %r after the step's wait_for_save; such layers are not saved", layer_name
                )
            return
        self._worker_host.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Once a step: vLLM calls it after ``get_finished`` too when a draft model runs (deferred finalize)."""
        if not self._saved:
            self._saved = True
            if not self._timed:
                self._worker_host.wait_for_save()
                return
            started = perf_counter()
            self._worker_host.wait_for_save()
            timed, self._timed = self._timed, []
            self._observe_seconds(timed, "save", perf_counter() - started)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Collect the step's reports; the merged sets go to vLLM only without worker metadata.

        The step's saves are complete first (the contract's order), even when
        vLLM defers its ``wait_for_save`` past this call.
        """
        outputs, failed_async = self._end_step(finished_req_ids)
        if _HAS_WORKER_META:
            return None, None
        sending = {r for out in outputs.values() for r in out.finished_sending}
        recving = {r for out in outputs.values() for r in out.finished_recving} | failed_async
        return sending or None, recving or None

    def _end_step(self, finished_req_ids: set[str]) -> tuple[dict[str, KVConnectorOutput], set[str] | frozenset[str]]:
        """End the worker step: its outputs and failed async loads, and what vLLM asks for next, kept.

        Kept: the report (``build_connector_worker_meta``), the invalid blocks
        (``get_block_ids_with_load_errors``) and the stats.
        """
        self.wait_for_save()
        outputs = self._worker_host.get_finished(set(finished_req_ids))
        bound, self._bound = self._bound, _UNBOUND
        if not outputs and bound is _UNBOUND:  # the usual step: no report, no load, nothing awaited
            self._report, self._invalid, self._failed_recving = None, _NO_BLOCKS, _NO_IDS
            return outputs, _NO_IDS
        for name, loads in bound.loads.items():
            out = outputs.setdefault(name, KVConnectorOutput())
            if out.failed or name in bound.dropped or name in self._undecoded:
                out.failed = True  # the host recomputes its loads; vLLM learns it from the blocks below
                out.invalid_block_ids |= {b for blocks, _ in loads.values() for b in blocks}
        failed_async: set[str] | frozenset[str]
        failed_async, self._invalid = _failed_loads(bound.failed_loads) if bound.failed_loads else (_NO_IDS, _NO_BLOCKS)
        # A step with nothing to report (the usual one) sends no report, unless the scheduler waits on a
        # transfer: vLLM calls update_connector_output only on a step with a forward or a report.
        news = bool(failed_async) or bound.report
        for name, out in outputs.items():
            if out.is_empty():
                continue
            news = True
            if out.invalid_block_ids:
                self._invalid = self._invalid | out.invalid_block_ids
            gauges = self._telemetry[name].gauges
            for key, value in out.stats.items():
                if key in gauges:
                    self._stats.setdefault(GAUGES, {})[f"{name}.{key}"] = value
                elif not key.startswith("_"):  # private gauges reach the connector's scheduler side only
                    self._add_stat(f"{name}.{key}", value)
        self._report = WorkerReport(outputs, set(failed_async)) if news else None
        if self._per_request:  # vLLM takes these requests' failures, not blocks (see the module docstring)
            self._failed_recving, self._invalid = failed_async, _NO_BLOCKS
        return outputs, failed_async

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.33's report of a step's transfers: ``get_finished``'s, and the failed loads (several groups).

        A failed load is in ``finished_recving`` too, as ``KVConnectorTransferResults`` requires.
        """
        self._end_step(finished_req_ids)  # a vLLM with transfer results has worker metadata: the sets are its own
        failed, self._failed_recving = self._failed_recving, _NO_IDS
        return KVConnectorTransferResults(set(), set(failed), set(failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, _NO_BLOCKS
        return set(invalid)

    def _add_stat(self, key: str, value: float) -> None:
        if value:
            self._stats[key] = self._stats.get(key, 0) + value

    def get_kv_connector_stats(self) -> KVConnVllmStats | None:
        """What happened since the last call (vLLM asks each step, on both sides, and sums them per interval).

        Worker side: the connectors' counters and the seconds of each step's
        loads and saves. Scheduler side: lookups, hits and misses, failed loads,
        each connector's ``scheduler_stats()``; gathered here only after a step
        with news (a lookup, a worker report), so the usual step costs one test.
        """
        if self._news:
            self._news = False
            self._gather_scheduler_stats()
        if self.host.error_counts:
            self._count_errors()
        if not self._stats:
            return None
        stats, self._stats = KVConnVllmStats(data=self._stats), {}
        return stats

    def _gather_scheduler_stats(self) -> None:
        lookups, self._lookups = self._lookups, []
        for loader, missable, hit in lookups:
            for name in self._lookup_names:
                served = hit if name == loader else 0
                self._add_stat(f"{name}.lookups", 1)
                self._add_stat(f"{name}.hit_blocks", served)
                self._add_stat(f"{name}.missed_blocks", max(0, missable - served))
        for name, collect in self._scheduler_stats:
            try:
                reported = collect()
            except Exception:  # telemetry never stops the engine
                logger.exception("kvconn connector %r: scheduler_stats() failed; its stats are left out", name)
                continue
            gauges = self._telemetry[name].gauges
            for key, value in reported.items():
                if key in gauges:
                    self._stats.setdefault(GAUGES, {})[f"{name}.{key}"] = value
                else:
                    self._add_stat(f"{name}.{key}", value)

    def _count_errors(self) -> None:
        """The host's degraded calls since the last count, as ``degraded.<hook>_error`` per connector."""
        for (name, hook), count in self.host.error_counts.items():
            if (new := count - self._errors_seen.get((name, hook), 0)) > 0:
                self._errors_seen[(name, hook)] = count
                self._add_stat(f"{name}.degraded.{hook}_error", new)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnVllmStats | None:
        return KVConnVllmStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any) -> Any:
        """``vllm:kvconn_*`` series per connector (:mod:`.telemetry`), made in vLLM's front end."""
        return prom_metrics_class()(vllm_config, *args)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM's earliest call with the connector's config: the front end's config check, with full CUDA graphs.

        kvconn checks ``kv_connector_extra_config`` here (keys, connector names,
        their configs): a mistake stops ``vllm serve`` before an engine starts.
        Elsewhere vLLM first hands the config to the connector's constructor,
        after the model has loaded.
        """
        check_extra_config(dict(extra_config or {}))
        return bool(super().requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """vLLM's first call with the config where no front-end call has it (a CPU engine; no full CUDA graphs).

        vLLM 0.32 and 0.33 ask it once, in the engine core, when they resolve the
        KV-cache layout: after the weights load, before memory profiling, warm-up,
        and before any worker builds a connector. kvconn checks
        ``kv_connector_extra_config`` here too, so a mistake stops the engine
        there, in one process, instead of in every worker's connector.
        """
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        check_extra_config(dict(getattr(transfer, "kv_connector_extra_config", None) or {}))
        return super().get_required_kvcache_layout(vllm_config)

    def build_connector_worker_meta(self) -> KVConnVllmWorkerMetadata | None:
        report, self._report = self._report, None
        return KVConnVllmWorkerMetadata([encode_report(report)]) if report is not None else None

    # ---------------------------------------------------------------------- both

    def shutdown(self) -> None:
        self.host.shutdown()
