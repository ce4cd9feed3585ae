"""The ``reference`` driver: kvconn's own scheduler and worker, in one process.

Faithful to a real engine: every scheduler output crosses the wire encoder
and decoder, and the connector's worker side (when it serves that role) runs
on real torch KV caches with the reference model. Connector errors raise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._plugins.registry import connector_roles, load_connector_class
from ...block_state import BlockIds, KVConnectorBlockState
from ...connector import KVConnectorRole
from ...context import NULL_BLOCK_ID, ConnectorContext
from ...host import ConnectorHost, LoadPlan
from ...host.wire import (
    decode_model_runner_output,
    decode_scheduler_output,
    encode_metadata,
    encode_model_runner_output,
    encode_scheduler_output,
)
from ...metadata import KVConnectorMetadata
from ...outputs import KVConnectorOutput, SchedulerOutput
from ...reference.request import Request
from ...reference.scheduler import Scheduler, SchedulerConfig
from ...reference.stats import EngineStats
from ...reference.worker import ReferenceWorker
from ..utils import assert_scheduler_empty
from .driver import (
    DriverSpec,
    HandedTable,
    StepRecord,
    freeze,
    mutated_tables,
    observed_block_state,
    tracked_by_role,
)

__all__ = ["ReferenceDriver"]

#: What an injected failed load leaves in a block: far outside the model's KV range.
_GARBAGE = 3.0
#: What a freed block holds at once under ``scrub_freed`` (another value: the two are told apart).
_FREED = -5.0
#: Why the engine waits for a request in each ``get_finished`` report, for the message when it does not.
_AWAITED = {
    "finished_sending": "request_finished did not delay its free",
    "finished_recving": "no async load of it was in flight (a sync load is never reported)",
}


@dataclass
class _Victim:
    """The one load the driver makes fail: its last block, on the step it lands."""

    req_id: str
    step: int
    is_async: bool
    block_ids: list[tuple[int, int]]  # (group, block id)
    done: bool = False


class ReferenceDriver:
    """A :class:`~.driver.SchedulerDriver` over :mod:`kvconn.reference`.

    Beyond the protocol it exposes what engine-level checks need: the tokens
    each request generated and the engine's stats. With ``fail_first_load``
    the first load the connector performs lands garbage in its last block and
    is reported failed to the engine, which must recompute it. With
    ``scrub_freed`` (prefix caching off) every block is overwritten the moment
    it is freed, as a busy GPU cache reuses it: a save that still reads a
    freed block, or a load that skips a block, leaves garbage behind.

    ``worker_config`` (default: the spec's) configures the worker side alone:
    a fresh store namespace there makes every block the scheduler side finds
    go missing on load.

    Each step also records the tables the connector changed after they were
    handed to it, and ``get_finished`` reports of requests the engine was not
    waiting for.
    """

    def __init__(
        self,
        spec: DriverSpec,
        *,
        fail_first_load: bool = False,
        scrub_freed: bool = False,
        worker_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.num_blocks = spec.num_blocks
        cls = load_connector_class(spec.connector)
        self.metadata_type: type[KVConnectorMetadata] = getattr(cls, "Metadata", KVConnectorMetadata)
        roles = connector_roles(cls)
        config = SchedulerConfig(
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_num_seqs=spec.max_num_seqs,
            enable_prefix_caching=spec.enable_prefix_caching,
            kv_cache_groups=spec.kv_cache_groups,
        )
        self.context = ConnectorContext(block_size=spec.block_size, kv_cache_groups=spec.kv_cache_groups)
        self.name = spec.connector
        self.scheduler_host = self._host(KVConnectorRole.SCHEDULER, roles, spec.config)
        self.worker_host = self._host(KVConnectorRole.WORKER, roles, worker_config or spec.config)
        self.scheduler = Scheduler(config, host=self.scheduler_host, context=self.context)
        self.worker = ReferenceWorker(self.context, num_blocks=spec.num_blocks, host=self.worker_host)
        self.requests: dict[str, Request] = {}
        self._finished_calls: Counter[str] = Counter()
        self._withhold: frozenset[str] = frozenset()
        self._offered: frozenset[str] = frozenset()
        self._resolved: list[str] = []
        self._step = 0
        self._fail_first_load = fail_first_load
        self._victim: _Victim | None = None
        self._handed: list[HandedTable] = []
        self._loaded: dict[str, int] = {}
        self._awaiting: dict[str, set[str]] = {kind: set() for kind in _AWAITED}
        self._reported: dict[str, set[str]] = {kind: set() for kind in _AWAITED}
        self._wrap_hosts()
        if scrub_freed:
            if spec.enable_prefix_caching:
                raise ValueError("scrub_freed needs enable_prefix_caching=False: freed blocks stay prefix-cache hits")
            self.scheduler.kv_cache_manager.pool.on_free = self._scrub

    def _host(
        self, role: KVConnectorRole, roles: frozenset[KVConnectorRole], config: Mapping[str, Any] | None
    ) -> ConnectorHost | None:
        if role not in roles:
            return None
        return ConnectorHost.from_names(
            self.spec.connector, role=role, config=config, context=self.context, on_error="raise"
        )

    # ------------------------------------------------------------ observation

    def _wrap_hosts(self) -> None:
        """Observe the connector at the host boundary (instance attributes shadow methods)."""
        host = self.scheduler_host
        if host is None:
            return
        build, finished, after_alloc = host.build_connector_meta, host.request_finished, host.update_state_after_alloc

        def build_connector_meta(
            scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
        ) -> dict[str, KVConnectorMetadata]:
            observed = observed_block_state(block_state, self._withhold, self._resolved, self._handed)
            self._offered = frozenset(observed.req_ids)
            cached = scheduler_output.scheduled_cached_reqs
            self._hand(
                [
                    (f"scheduled_new_reqs {new.req_id!r} block_ids", new.block_ids)
                    for new in scheduler_output.scheduled_new_reqs
                ]
                + [
                    (f"scheduled_cached_reqs {req_id!r} new_block_ids", ids)
                    for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
                    if ids is not None
                ]
            )
            return build(scheduler_output, observed)

        def request_finished(request: Any, block_ids: BlockIds) -> bool:
            self._finished_calls[request.request_id] += 1
            self._hand([(f"request_finished {request.request_id!r} block_ids", block_ids)])
            delayed = finished(request, block_ids)
            if delayed:
                self._awaiting["finished_sending"].add(request.request_id)
            return delayed

        def update_state_after_alloc(request: Any, block_ids: BlockIds, plan: LoadPlan) -> bool:
            self._hand([(f"update_state_after_alloc {request.request_id!r} block_ids", block_ids)])
            loading = after_alloc(request, block_ids, plan)
            if loading and plan.num_tokens:
                self._loaded[request.request_id] = plan.num_tokens
                if plan.load_async:
                    self._awaiting["finished_recving"].add(request.request_id)
            if loading and plan.num_tokens and self._fail_first_load and self._victim is None:
                last = (request.num_computed_tokens + plan.num_tokens) // self.block_size - 1
                blocks = [(g, t[last]) for g, t in enumerate(block_ids) if t[last] != NULL_BLOCK_ID]
                self._victim = _Victim(request.request_id, self._step, plan.load_async, blocks)
            return loading

        host.build_connector_meta = build_connector_meta  # type: ignore[method-assign]
        host.request_finished = request_finished  # type: ignore[method-assign]
        host.update_state_after_alloc = update_state_after_alloc  # type: ignore[method-assign]
        if self.worker_host is not None and self._fail_first_load:
            self._wrap_worker(self.worker_host)

    def _wrap_worker(self, host: ConnectorHost) -> None:
        wait_for_layer_load, get_finished = host.wait_for_layer_load, host.get_finished
        groups = self.context.group_of_layer()

        def corrupting_wait(layer_name: str) -> None:
            wait_for_layer_load(layer_name)
            victim = self._victim
            if victim is not None and not victim.is_async and victim.step == self._step:
                self._corrupt(victim, [layer_name], groups)

        def reporting_get_finished(finished_req_ids: set[str]) -> Any:
            outputs = get_finished(finished_req_ids)
            victim, out = self._victim, outputs.get(self.name)
            if victim is None or victim.done or out is None:
                return outputs
            if victim.is_async and victim.req_id in out.finished_recving:
                self._corrupt(victim, list(groups), groups)
            elif victim.is_async or victim.step != self._step:
                return outputs
            out.invalid_block_ids |= {b for _, b in victim.block_ids}
            victim.done = True
            return outputs

        host.wait_for_layer_load = corrupting_wait  # type: ignore[method-assign]
        host.get_finished = reporting_get_finished  # type: ignore[method-assign]

    def _hand(self, tables: list[tuple[str, BlockIds]]) -> None:
        """Remember tables handed to the connector, with a snapshot, to see if it changes them."""
        self._handed += [(where, table, freeze(table)) for where, table in tables]

    def _unexpected_reports(self, out: KVConnectorOutput) -> list[str]:
        """Ids in ``out``'s finished sets the engine was not waiting for; settles the ones it was."""
        found = []
        for kind, why in _AWAITED.items():
            awaiting, reported = self._awaiting[kind], self._reported[kind]
            for req_id in sorted(getattr(out, kind)):
                if req_id in awaiting:
                    awaiting.discard(req_id)
                    reported.add(req_id)
                elif req_id in reported:
                    found.append(f"{kind} reported {req_id!r} a second time")
                elif req_id in self.requests:
                    found.append(f"{kind} reported {req_id!r}, which the engine was not waiting for: {why}")
                else:
                    found.append(f"{kind} reported {req_id!r}, a request id the engine never had")
        return found

    def _scrub(self, block_ids: list[int]) -> None:
        for kv in self.worker.kv_caches.values():
            kv[block_ids] = _FREED

    def _corrupt(self, victim: _Victim, layers: Sequence[str], groups: dict[str, int]) -> None:
        for layer in layers:
            for group, block_id in victim.block_ids:
                if groups[layer] == group:
                    self.worker.kv_caches[layer][block_id].fill_(_GARBAGE)

    @property
    def injected_failure(self) -> bool:
        """Whether the driver made a load fail (``fail_first_load``)."""
        return self._victim is not None and self._victim.done

    # ---------------------------------------------------------------- protocol

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        request = Request(req_id, prompt, max_tokens, self.block_size)
        self.scheduler.add_request(request)
        self.requests[req_id] = request

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id])

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        self._withhold, self._resolved, self._offered = frozenset(withhold), [], frozenset()
        preemptions = {r: req.num_preemptions for r, req in self.requests.items()}
        output = self.scheduler.schedule()
        kv = self.scheduler.kv_cache_manager
        holding = [*self.scheduler.requests, *self.scheduler.held_requests]
        tables = {r: kv.get_block_ids(r) for r in holding if kv.has_request(r)}
        metadata = (output.kv_connector_metadata or {}).get(self.name)
        encoded = encode_metadata(self.name, metadata) if metadata is not None else None
        sent = decode_scheduler_output(encode_scheduler_output(output), {self.name: self.metadata_type})
        decoded = (sent.kv_connector_metadata or {}).get(self.name)
        runner_output = self.worker.execute_model(sent)
        returned = decode_model_runner_output(encode_model_runner_output(runner_output))
        connector_output = runner_output.kv_connector_output.get(self.name) if self.worker_host else None
        # before update_from_output: a request finishing this step is not awaited by this step's report
        unexpected = self._unexpected_reports(connector_output) if connector_output is not None else []
        self.scheduler.update_from_output(output, returned)
        self._step += 1
        # every table handed so far: a connector may keep one and change it steps later
        mutated = mutated_tables(self._handed)
        if mutated:
            self._handed = [handed for handed in self._handed if freeze(handed[1]) == handed[2]]
        loaded, self._loaded = self._loaded, {}
        return StepRecord(
            output=output,
            metadata=metadata,
            decoded=decoded,
            encoded=encoded,
            tables=tables,
            offered=self._offered,
            resolved=self._resolved,
            connector_output=connector_output,
            preempted={r for r, n in preemptions.items() if self.requests[r].num_preemptions > n},
            mutated=mutated,
            unexpected_reports=unexpected,
            loaded=loaded,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def num_tracked_requests(self) -> dict[str, int]:
        return tracked_by_role(self.name, self.scheduler_host, self.worker_host)

    def assert_empty(self) -> None:
        assert_scheduler_empty(self.scheduler)

    def close(self) -> None:
        for host in (self.scheduler_host, self.worker_host):
            if host is not None:
                host.shutdown()

    # ------------------------------------------------------------ engine-level

    def generated(self, req_id: str) -> list[int]:
        """The tokens ``req_id`` generated so far."""
        return list(self.requests[req_id].output_token_ids)

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats
