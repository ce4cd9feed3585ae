"""The scheduler side of :class:`~.connector.KVConnVllmConnector`: vLLM's scheduler calls, on a ``SchedulerHost``.

:class:`KVConnVllmScheduler` plans and commits loads (vLLM's ``get_num_new_matched_tokens`` /
``update_state_after_alloc``), offers each step's block state and encodes the connectors' metadata into a
:class:`~.metadata.KVConnVllmMetadata` (or an :data:`~.metadata.IdleStep`), and turns the workers' reports into
the host's decision, written back into vLLM's ``KVConnectorOutput``. The failed-load rules it follows are in
:mod:`.connector`'s docstring.

Read by :mod:`.connector` only (the shell vLLM loads). A change to what it sends must match :mod:`.worker`, which
reads it; the vLLM tiers (``tests/vllm``, ``tests/vllm_029``) and ``benchmarks/vllm_step_overhead.py`` (its
per-step cost) are what check it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvconn.block_state import KVConnectorBlockState, block_ids_in_range
from kvconn.connector import KVConnectorRole
from kvconn.context import ConnectorContext
from kvconn.errors import KVConnError
from kvconn.host import NO_LOAD, ConnectorHost, LoadPlan, LoadSpec, SchedulerHost, StepUpdate
from kvconn.host.wire import encode_metadata
from kvconn.introspection import connector_roles, hook_object
from kvconn.metadata import KVConnectorMetadata as KVConnMetadata
from kvconn.outputs import KVConnectorOutput

from .compat import HAS_WORKER_META, fails_per_request
from .metadata import NO_IDS, IdleStep, KVConnVllmMetadata, KVConnVllmStats, KVConnVllmWorkerMetadata
from .reports import ReportCollector
from .tables import TableTracker
from .telemetry import ConnectorTelemetry, StepStats, hit_source, to_vllm_events
from .translate import VllmRequestView, to_block_ids, translate_scheduler_output

__all__ = ["KVConnVllmScheduler"]

logger = logging.getLogger("kvconn.vllm")


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
    """The scheduler's :data:`~.metadata.IdleStep`, and each builder's default metadata with its encoding.

    ``None`` when a builder's ``Metadata`` has no stable default: every step then sends its metadata.
    """
    found = {name: _stable_default(name, host.metadata_types[name]) for name in builders}
    defaults = {name: pair for name, pair in found.items() if pair is not None}
    return (tuple(builders) if len(defaults) == len(found) else None), defaults


class KVConnVllmScheduler:
    """vLLM's scheduler-side connector calls, translated for ``host`` (see the module docstring).

    ``telemetry``: each hosted connector's declarations; ``publishes_events``: whether vLLM publishes
    KV-cache events (``kv_events_config``), so :meth:`take_events` asks the connectors for theirs.
    """

    def __init__(
        self,
        host: SchedulerHost,
        context: ConnectorContext,
        vllm_config: Any,
        telemetry: dict[str, ConnectorTelemetry],
        *,
        publishes_events: bool,
    ) -> None:
        self.host, self.context = host, context
        self._telemetry = telemetry
        self._publishes_events = publishes_events
        if publishes_events:  # a connector records no events until its take_events is first called
            self.take_events()
        self._step = 0
        self._plans: dict[str, tuple[LoadPlan, int]] = {}
        # The loads in flight are the host's record (SchedulerHost.loads_in_flight). These are the adapter's own:
        # loads vLLM planned that no connector does (the loader failed committing them), and, with several groups,
        # loads that ended with a failed block; the host is done with both, vLLM is not until the workers report
        # them (invalid blocks, or failed_recving), so they go out once in the next step's metadata.
        self._failed_loads: dict[str, LoadSpec] = {}
        self._tracker: TableTracker | None = None
        self._sliding = any(g.sliding_window is not None for g in context.kv_cache_groups)
        # several groups under a vLLM with failed_recving: failed loads go per request (see .connector's docstring)
        self._per_request = fails_per_request(len(context.kv_cache_groups))
        # Metadata goes to workers only for connectors that run there (scheduler-only ones are left out).
        self._sent = {n for n, c in host.connectors.items() if KVConnectorRole.WORKER in connector_roles(type(c))}
        self._builders = [
            n for n, c in host.connectors.items() if n in self._sent and hasattr(hook_object(c), "build_connector_meta")
        ]
        self._idle, self._defaults = _idle_step(host, self._builders)
        self._collector = ReportCollector(host.names, int(vllm_config.parallel_config.world_size))
        # Stats for vLLM, and what they are gathered from off the step path: the lookups (loader, blocks missed,
        # blocks hit) and whether anything happened since the last gathering (news: a lookup, a worker report).
        self._stats = StepStats(host)
        self._lookups: list[tuple[str | None, int, int]] = []
        self._news = False
        self._loader: tuple[str, str | None] = ("", None)  # the last request update_state_after_alloc saw
        self._lookup_names = host.implementers("get_num_new_matched_tokens")
        self._scheduler_stats: list[tuple[str, Callable[[], Any]]] = [
            (n, fn)
            for n, c in host.connectors.items()
            if callable(fn := getattr(hook_object(c), "scheduler_stats", None))
        ]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self.host.get_num_new_matched_tokens(VllmRequestView(request), num_computed_tokens)
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
        loading = self.host.update_state_after_alloc(view, block_ids, plan)
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
        for name, connector in self.host.connectors.items():
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
        host = self.host
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
        return self.host.request_finished(VllmRequestView(request), to_block_ids(block_ids)), None

    def update_connector_output(self, connector_output: Any) -> None:
        """Hand each connector its report, then make vLLM act on the host's merged decision.

        vLLM reads ``finished_sending`` / ``finished_recving`` from this same
        object right after this call, so they are replaced in place by what
        the host decided (e.g. a free delayed by two connectors waits for both).
        """
        worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if worker_meta is None and HAS_WORKER_META and self.host.count_quiet_step():
            connector_output.finished_sending = connector_output.finished_recving = None  # no worker had news
            return
        failed_recving: set[str] | frozenset[str]
        if isinstance(worker_meta, KVConnVllmWorkerMetadata):
            outputs, failed_recving = self._collector.collect(worker_meta.reports)
        elif worker_meta is None and HAS_WORKER_META:  # no worker had anything to report
            outputs, failed_recving = {}, NO_IDS
        else:
            outputs, failed_recving = self._attribute(connector_output)
        host = self.host
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
        for name, loads in self.host.loads_in_flight().items():
            out = outputs.get(name)
            if out is not None:
                failed = sum(out.failed or not out.invalid_block_ids.isdisjoint(blocks) for blocks, _ in loads.values())
                self._stats.add(f"{name}.failed_loads", failed)

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
        loads, blocks = self.host.pending_loads(), self.host.pending_load_blocks()
        outputs = {
            name: KVConnectorOutput(
                finished_sending=set(sending),
                finished_recving=recving & loads.get(name, set()),
                invalid_block_ids=invalid & blocks.get(name, set()),
            )
            for name in self.host.names
        }
        return outputs, recving - {r for ids in loads.values() for r in ids}

    def get_kv_connector_stats(self) -> KVConnVllmStats | None:
        """Lookups, hits and misses, failed loads, each connector's ``scheduler_stats()``, degraded calls.

        Gathered here only after a step with news (a lookup, a worker report), so the usual step costs one test.
        """
        if self._news:
            self._news = False
            self._gather_stats()
        if not self._stats.data and not self.host.error_counts:
            return None  # the usual step: nothing to take (checked here, a call less on every step)
        data = self._stats.take()
        return KVConnVllmStats(data=data) if data is not None else None

    def _gather_stats(self) -> None:
        lookups, self._lookups = self._lookups, []
        for loader, missable, hit in lookups:
            for name in self._lookup_names:
                served = hit if name == loader else 0
                self._stats.add(f"{name}.lookups", 1)
                self._stats.add(f"{name}.hit_blocks", served)
                self._stats.add(f"{name}.missed_blocks", max(0, missable - served))
        for name, collect in self._scheduler_stats:
            try:
                reported = collect()
            except Exception:  # telemetry never stops the engine
                logger.exception("kvconn connector %r: scheduler_stats() failed; its stats are left out", name)
                continue
            self._stats.add_reported(name, reported, self._telemetry[name].gauges, private=True)
