"""The ``reference`` driver: kvconn's reference :class:`~kvconn.reference.Engine`, in one process.

Faithful to a real engine: every scheduler output crosses the wire encoder
and decoder, and the connector's worker side (when it serves that role) runs
on real torch KV caches with the reference model. The driver steps the
engine as it is and observes through monitors on its hosts. Connector errors raise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...block_state import BlockIds
from ...context import NULL_BLOCK_ID
from ...host import CallOutcome, ConnectorHost, LoadPlan
from ...host.wire import encode_metadata
from ...outputs import KVConnectorOutput
from ...reference.engine import Engine
from ...reference.model import adapter_seed
from ...reference.request import Request
from ...reference.stats import EngineStats
from ..utils import assert_scheduler_empty
from .diagnose import Awaited
from .driver import (
    NO_KEYS,
    DriverSpec,
    HandedTable,
    RequestKeys,
    StepRecord,
    freeze,
    mutated_tables,
    observe_block_state,
    tracked_by_role,
)
from .fault_injection import FailureMode, watch_data_run
from .loaded_kv import LoadedBlock, audit_load, freed_value
from .waits import wait_seconds
from .worker_process import WorkerProcess

__all__ = ["ReferenceDriver"]

#: Why the engine waits for a request in each ``get_finished`` report, for the message when it does not.
_AWAITED = {
    "finished_sending": "request_finished did not delay its free",
    "finished_recving": "no async load of it was in flight (a sync load is never reported)",
}


@dataclass(frozen=True)
class _Load:
    """A load the connector set out to do, audited once it lands (under ``scrub_freed``)."""

    req_id: str
    step: int
    is_async: bool
    token_ids: list[int]
    seed: int  # the request's adapter's (its KV depends on it)
    table: list[list[int]]
    blocks: range


class ReferenceDriver:
    """A :class:`~.driver.SchedulerDriver` over the reference :class:`~kvconn.reference.Engine`.

    It steps the engine as it is and observes the connector through monitors
    on the engine's hosts (:meth:`~kvconn.ConnectorHost.add_monitor`).
    Beyond the protocol it exposes what engine-level checks need: the tokens
    each request generated and the engine's stats. With ``fail_loads`` (a
    :class:`~.fault_injection.LoadFailures` mode) loads land garbage and are reported
    failed to the engine, which must recover: ``"first"``, the connector's
    first load, in its last block; ``"persistent"``, every load of its first
    loaded block's content. A :class:`~.convergence.ConvergenceWatch` stops a
    connector that would keep a request from ever finishing. With
    ``scrub_freed`` (prefix caching off) every block is overwritten the moment
    it is freed, as a busy GPU cache reuses it: a save that still reads a
    freed block, or a load that skips a block, leaves garbage behind.

    ``fail_first_load=True`` (the older spelling) is ``fail_loads="first"``.
    ``worker_config`` (default: the spec's) configures the worker side alone:
    a fresh store namespace there makes every block the scheduler side finds
    go missing on load. With ``worker_process`` the worker runs in a spawned
    process (:class:`~.worker_process.WorkerProcess`), as vLLM's multiprocess
    engine runs it: a store kept in this process's memory is empty there. The
    worker-side observations (reports awaited, failed loads injected, freed
    blocks scrubbed) then do not apply.

    Each step also records the tables the connector changed after they were
    handed to it, and ``get_finished`` reports of requests the engine was not
    waiting for.
    """

    def __init__(
        self,
        spec: DriverSpec,
        *,
        fail_loads: FailureMode | None = None,
        scrub_freed: bool = False,
        worker_config: Mapping[str, Any] | None = None,
        worker_process: bool = False,
        fail_first_load: bool = False,
    ) -> None:
        if fail_first_load:  # the name before fail_loads, kept working
            fail_loads = "first"
        if scrub_freed and spec.shape.enable_prefix_caching:
            raise ValueError("scrub_freed needs enable_prefix_caching=False: freed blocks stay prefix-cache hits")
        self.spec, self.shape = spec, spec.shape
        self.block_size = spec.shape.block_size
        self.num_blocks = spec.shape.num_blocks
        self.name = spec.connector
        # The host's stall bound in wall time is the suite's (--wait-s): a delayed free reported half a second
        # later is in time however many busy steps pass meanwhile; one never reported is released past both bounds.
        self.engine = Engine(
            spec.connector,
            spec.config,
            worker_config=worker_config,
            on_error="raise",
            stall_s=wait_seconds(),
            shape=spec.shape,
        )
        self.scheduler, self.worker = self.engine.scheduler, self.engine.worker
        self._process: WorkerProcess | None = None
        if worker_process:
            config = worker_config if worker_config is not None else spec.config
            self._process = WorkerProcess(spec.connector, config, self.engine.context, spec.shape)
            # the engine steps it in place of its own worker, which (and whose connector) then stays idle
            self.engine.executor = self._process  # type: ignore[assignment]
        self.requests: dict[str, Request] = {}
        self._finished_calls: Counter[str] = Counter()
        self._withhold: frozenset[str] = frozenset()
        self._step = 0
        self._handed: list[HandedTable] = []
        #: per report kind, the requests the engine waits for: the step and the answer that started the wait
        self._awaiting: dict[str, dict[str, tuple[int, str]]] = {kind: {} for kind in _AWAITED}
        self._reported: dict[str, set[str]] = {kind: set() for kind in _AWAITED}
        self._record: dict[str, Any] = {}  # this step's observations
        self._loads: list[_Load] = []  # loads not landed yet (audited under scrub_freed)
        #: every layer of every landed load's block that did not hold the KV the model computes (scrub_freed)
        self.wrong_loads: list[LoadedBlock] = []
        #: the steps at which each block was freed (scrub_freed)
        self.freed_at: dict[int, list[int]] = {}
        self._audit = scrub_freed
        self.failures = watch_data_run(
            self.name,
            fail_loads,
            engine="reference engine",
            block_size=self.block_size,
            hosts=self._monitor(),
            kv_caches=self.worker.kv_caches,
            group_of_layer=self.engine.context.group_of_layer(),
        )
        if scrub_freed:
            self.scheduler.kv_cache_manager.pool.on_free = self._scrub

    # ------------------------------------------------------------ observation

    def _monitor(self) -> tuple[ConnectorHost, ConnectorHost]:
        """Observe the connector at both hosts' boundary (the reference engine always has both); returns them."""
        scheduler, worker = self.engine.scheduler_host, self.engine.worker_host
        assert scheduler is not None and worker is not None
        scheduler.add_monitor(
            self._before_scheduler_call,
            self._after_scheduler_call,
            calls=("build_connector_meta", "request_finished", "update_state_after_alloc", "update_connector_output"),
        )
        worker.add_monitor(after=self._after_worker_call, calls=("bind_connector_metadata", "get_finished"))
        return scheduler, worker

    def _before_scheduler_call(self, call: str, args: tuple[Any, ...]) -> None:
        if call == "build_connector_meta":
            output, block_state = args
            observe_block_state(block_state, self._withhold, self._record["resolved"], self._handed)
            cached = output.scheduled_cached_reqs
            self._hand(
                [(f"scheduled_new_reqs {new.req_id!r} block_ids", new.block_ids) for new in output.scheduled_new_reqs]
                + [
                    (f"scheduled_cached_reqs {req_id!r} new_block_ids", ids)
                    for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
                    if ids is not None
                ]
            )
        elif call == "request_finished":
            request, block_ids = args
            self._finished_calls[request.request_id] += 1
            self._hand([(f"request_finished {request.request_id!r} block_ids", block_ids)])
        elif call == "update_state_after_alloc":
            request, block_ids, _ = args
            self._hand([(f"update_state_after_alloc {request.request_id!r} block_ids", block_ids)])
        else:  # update_connector_output, before update_from_output: a request finishing this step is not awaited
            out = args[0].get(self.name)
            self._record["unexpected"] = self._unexpected_reports(out) if out is not None else []

    def _after_scheduler_call(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if outcome.exception is not None:
            return
        if call == "build_connector_meta":
            # the end of schedule(): the tables now are those the connector was offered
            kv = self.scheduler.kv_cache_manager
            holding = [*self.scheduler.requests, *self.scheduler.held_requests]
            self._record.update(
                output=args[0],
                offered=frozenset(args[1].req_ids),
                metadata=outcome.result.get(self.name),
                tables={r: kv.get_block_ids(r) for r in holding if kv.has_request(r)},
            )
        elif call == "request_finished":
            if outcome.result:
                answer = "request_finished returned True for it (a delayed free)"
                self._awaiting["finished_sending"][args[0].request_id] = (self._step, answer)
        elif call == "update_state_after_alloc":
            self._after_alloc(*args, loading=outcome.result)

    def _after_alloc(self, request: Request, block_ids: BlockIds, plan: LoadPlan, *, loading: bool) -> None:
        if not (loading and plan.num_tokens):
            return
        self._record["loaded"][request.request_id] = plan.num_tokens
        if self._audit:
            first = request.num_computed_tokens // self.block_size
            span = range(first, first + plan.num_tokens // self.block_size)
            table = [list(t) for t in block_ids]
            tokens, seed = list(request.all_token_ids), adapter_seed(self.requests[request.request_id].adapter)
            load = _Load(request.request_id, self._step, plan.load_async, tokens, seed, table, span)
            self._loads.append(load)
        if plan.load_async:
            answer = f"get_num_new_matched_tokens returned ({plan.num_tokens}, True) for it (an async load)"
            self._awaiting["finished_recving"][request.request_id] = (self._step, answer)

    def _after_worker_call(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if outcome.exception is not None:
            return
        if call == "bind_connector_metadata":  # the metadata as the worker decoded it
            self._record["decoded"] = (args[0] or {}).get(self.name)
            return
        self._record["connector_output"] = outcome.result.get(self.name)  # get_finished

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
                    del awaiting[req_id]
                    reported.add(req_id)
                elif req_id in reported:
                    found.append(f"{kind} reported {req_id!r} a second time")
                elif req_id in self.requests:
                    found.append(f"{kind} reported {req_id!r}, which the engine was not waiting for: {why}")
                else:
                    found.append(f"{kind} reported {req_id!r}, a request id the engine never had")
        return found

    def _scrub(self, block_ids: list[int]) -> None:
        """Fill each freed block with the pattern naming it (:func:`~.loaded_kv.freed_value`)."""
        torch = self.worker.model.torch
        values = torch.tensor([freed_value(b) for b in block_ids]).view(-1, 1, 1, 1, 1)
        for kv in (kv for worker in self.engine.workers for kv in worker.kv_caches.values()):
            kv[block_ids] = values.to(kv.dtype)
        for block_id in block_ids:
            self.freed_at.setdefault(block_id, []).append(self._step)

    def _audit_landed(self, out: KVConnectorOutput | None) -> None:
        """Audit the loads that landed this step: sync ones started now, async ones reported finished now."""
        received = out.finished_recving if out is not None else set()
        skip = set(out.invalid_block_ids) if out is not None else set()
        if self.failures is not None:  # the blocks it made fail this step hold its garbage, reported failed
            skip |= self.failures.failed_blocks
        landed = [
            load for load in self._loads if (load.req_id in received if load.is_async else load.step == self._step)
        ]
        self._loads = [load for load in self._loads if load not in landed]
        layers = [(name, group) for name, group, _ in self.worker.layers]
        models = [worker.model for worker in self.engine.workers]
        for load in landed:
            for worker in self.engine.workers:  # every rank's shard: a key without the rank mixes them
                self.wrong_loads += audit_load(
                    worker.model,
                    worker.kv_caches,
                    layers,
                    req_id=load.req_id,
                    step=load.step,
                    token_ids=load.token_ids,
                    seed=load.seed,
                    table=load.table,
                    blocks=load.blocks,
                    skip=skip,
                    ranks=models,
                )

    def awaited(self) -> list[Awaited]:
        """The reports the engine still waits for, oldest first (see :func:`~.diagnose.stall`)."""
        waits = [
            Awaited(req_id, kind, step, answer, ended=req_id not in self.scheduler.requests)
            for kind, awaiting in self._awaiting.items()
            for req_id, (step, answer) in awaiting.items()
        ]
        return sorted(waits, key=lambda a: a.step)

    def situation(self) -> list[str]:
        """What the step in progress has that a connector may not cope with (see :func:`~.diagnose.diagnose_error`).

        Tables holding null blocks (a sliding window dropped them), requests
        resumed after preemption (a new table), requests that finished, and
        the requests this step schedules.
        """
        kv = self.scheduler.kv_cache_manager
        facts = []
        for req_id, request in self.requests.items():
            if not kv.has_request(req_id):
                continue
            nulls = [
                f"group {g} positions {_span([i for i, b in enumerate(t) if b == NULL_BLOCK_ID])}"
                for g, t in enumerate(kv.get_block_ids(req_id))
                if NULL_BLOCK_ID in t
            ]
            if nulls:
                facts.append(f"the table of {req_id!r} holds null blocks (sliding window) at {', '.join(nulls)}")
            if request.num_preemptions and not request.is_finished:
                facts.append(f"{req_id!r} was preempted and resumed with a new table")
        out = self._record.get("output")
        if out is not None:
            if out.finished_req_ids:
                facts.append(f"{sorted(out.finished_req_ids)} finished")
            facts.append(f"scheduled {dict(sorted(out.num_scheduled_tokens.items()))} tokens")
        return facts

    @property
    def injected_failure(self) -> bool:
        """Whether the driver made a load fail (``fail_loads``)."""
        return self.failures is not None and self.failures.failed > 0

    # ---------------------------------------------------------------- protocol

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int, keys: RequestKeys = NO_KEYS) -> None:
        self.requests[req_id] = self.engine.add_request(prompt, max_tokens, req_id, **keys._asdict())

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        self._withhold = frozenset(withhold)
        record = self._record = {"resolved": [], "loaded": {}, "unexpected": [], "connector_output": None}
        preemptions = {r: req.num_preemptions for r, req in self.requests.items()}
        self.engine.step()
        if self._audit:
            self._audit_landed(record["connector_output"])
        self._step += 1
        # every table handed so far: a connector may keep one and change it steps later
        mutated = mutated_tables(self._handed)
        if mutated:
            self._handed = [handed for handed in self._handed if freeze(handed[1]) == handed[2]]
        metadata = record["metadata"]
        return StepRecord(
            output=record["output"],
            metadata=metadata,
            decoded=record.get("decoded"),
            encoded=encode_metadata(self.name, metadata) if metadata is not None else None,
            tables=record["tables"],
            offered=record["offered"],
            resolved=record["resolved"],
            connector_output=record["connector_output"],
            preempted={r for r, n in preemptions.items() if self.requests[r].num_preemptions > n},
            mutated=mutated,
            unexpected_reports=record["unexpected"],
            loaded=record["loaded"],
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def num_tracked_requests(self) -> dict[str, int]:
        return tracked_by_role(self.name, self.engine.scheduler_host, self.engine.worker_host)

    def assert_empty(self) -> None:
        assert_scheduler_empty(self.scheduler)

    def close(self) -> None:
        self.engine.close()
        if self._process is not None:
            self._process.close()

    # ------------------------------------------------------------ engine-level

    def generated(self, req_id: str) -> list[int]:
        """The tokens ``req_id`` generated so far."""
        return list(self.requests[req_id].output_token_ids)

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats


def _span(positions: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
