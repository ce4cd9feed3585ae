"""The scheduler's host: routing lookups and loads, and the bookkeeping of transfers in flight.

The first connector that reports matched tokens loads the request; every
connector is told about allocations and finished requests and may delay a
free; each builds its own metadata for its workers. The host keeps what the
workers must later report on: loads in flight per connector (sync ones end
with their step, async ones when reported), async loads failed while in
flight (so a late report of one is not taken for a stray), delayed frees
(released once every connector that delayed them is done), and "ask me
again" answers in a row. Each bounded by ``stall_steps`` and ``stall_s``
(a wait is a stall past both): see :mod:`.connector_host`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..block_state import BlockIds, KVConnectorBlockState, block_ids_in_range
from ..connector import KVConnectorRole
from ..hookspecs import SCHEDULER_HOOKS
from ..metadata import KVConnectorMetadata
from ..outputs import KVConnectorOutput, SchedulerOutput
from ..request import ConnectorRequest
from .answers import BadHookAnswer, match
from .connector_host import ConnectorHost

__all__ = ["NO_LOAD", "LoadPlan", "LoadSpec", "SchedulerHost", "StepUpdate"]

logger = logging.getLogger("kvconn.host")


@dataclass(frozen=True)
class LoadPlan:
    """The host's answer to "can a connector load this request's prefix?".

    ``num_tokens`` is ``None`` when a connector asked to be asked again later.
    """

    num_tokens: int | None = 0
    load_async: bool = False
    connector: str | None = None


NO_LOAD = LoadPlan()
_NO_HIT = (0, False)  # the usual lookup answer


def _counter() -> Counter[str]:
    """An empty ``Counter`` at half the cost of ``Counter()`` (whose ``__init__`` calls ``update``): one a step."""
    return Counter.__new__(Counter)


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
    stats: Counter[str] = field(default_factory=_counter)


def _metadata_check(expected: type[KVConnectorMetadata]) -> Callable[[Any], Any]:
    """A check refusing metadata that is not an instance of ``expected`` (the connector's ``Metadata``)."""

    def check(meta: Any) -> Any:
        if not isinstance(meta, expected):
            raise TypeError(f"returned {type(meta).__name__}, not an instance of {expected.__name__}")
        return meta

    return check


#: One load in flight as an engine reads it: ``(block ids, is_async)``.
LoadSpec = tuple[list[int], bool]


@dataclass
class _Load:
    block_ids: list[int]
    is_async: bool
    sent: bool = False  # its metadata reached the workers
    build: int = 0  # the build_connector_meta call of the step it was committed for


class SchedulerHost(ConnectorHost, role=KVConnectorRole.SCHEDULER):
    """The host of an engine's scheduler (arguments as for :class:`~kvconn.ConnectorHost`)."""

    hooks = SCHEDULER_HOOKS

    def _init_role(self) -> None:
        #: (name, build_connector_meta, the check that it returns an instance of the connector's Metadata)
        self._metadata_builders = [
            (name, call, _metadata_check(self.metadata_types[name]))
            for name, call in self._impls["build_connector_meta"]
        ]
        self._step = 0  # update_connector_output calls: the scheduler's step count
        self._builds = 0  # build_connector_meta calls
        #: (connector, request) -> "ask again" answers in a row and the clock() time of the first; -1: given up on
        self._asks: dict[tuple[str, str], tuple[int, float]] = {}
        self._send_steps: dict[str, tuple[int, float]] = {}  # delayed free -> the step and clock() time it began
        self._loads: dict[str, dict[str, _Load]] = {name: {} for name in self.connectors}  # in flight
        #: per connector, async loads failed while in flight (request id -> the step and clock() time it was failed):
        #: a later report of one is no stray
        self._abandoned: dict[str, dict[str, tuple[int, float]]] = {name: {} for name in self.connectors}
        self._sending: dict[str, set[str]] = {}  # delayed free -> the connectors delaying it

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

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> LoadPlan:
        """Ask each connector in order; the first that reports tokens loads.

        A bad answer (see :func:`.answers.match`) counts as no hit. A connector
        that asks to be asked again about one request more than
        ``stall_steps`` times in a row, over more than ``stall_s`` seconds, is
        failed once, then counts as having no hit for that request.
        """
        req_id = request.request_id
        num_tokens: int | None
        for name, result in self._each("get_num_new_matched_tokens", (request, num_computed_tokens)):
            if result is None or (result.__class__ is tuple and result == _NO_HIT):  # the usual answer, checked fast
                num_tokens, load_async = 0, False
            else:
                try:
                    num_tokens, load_async = match(
                        result, num_computed_tokens, request.num_tokens, self.context.block_size
                    )
                except BadHookAnswer as exc:
                    self._fail(name, "get_num_new_matched_tokens", exc)
                    continue
            if num_tokens is None:
                asks, since = self._asks.get((name, req_id)) or (0, self.clock())
                if asks < 0:
                    continue  # given up on (failed once): no hit
                asks += 1
                if not self._stalled(asks, since):
                    self._asks[name, req_id] = (asks, since)
                    return LoadPlan(None, False, name)
                self._asks[name, req_id] = (-1, since)
                self._fail(
                    name,
                    "get_num_new_matched_tokens",
                    BadHookAnswer(
                        f"asked to be asked again about request {req_id!r} {asks} times in a row, for more than "
                        f"{self._stall_bounds()}; the engine stops waiting for it and computes the request"
                    ),
                )
                continue
            if self._asks:
                self._asks.pop((name, req_id), None)
            if num_tokens > 0:
                return LoadPlan(num_tokens, load_async, name)
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
                self._loads[name][request.request_id] = _Load(blocks, plan.load_async, build=self._builds + 1)
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
        self._builds += 1
        if self._failed_this_step:
            self._failed_this_step.clear()
        try:
            if self._impls["on_block_state"]:
                self._notify("on_block_state", (block_state, scheduler_output))
            metadata: dict[str, KVConnectorMetadata] = {}
            # Called per connector, not through _each: a connector's metadata counts only when nothing of this step
            # failed it (on_block_state included), and its loads are then sent.
            args = (scheduler_output, block_state)
            for name, call, check in self._metadata_builders:
                if name in self._skip:
                    continue
                meta = self._call(name, call, "build_connector_meta", args, check)
                if name not in self._failed_this_step:  # else it raised, answered badly, or failed in on_block_state
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
            self._send_steps[req_id] = (self._step, self.clock())
        return bool(delayed)

    def update_connector_output(self, outputs: Mapping[str, KVConnectorOutput]) -> StepUpdate:
        """Hand each connector its worker report and merge what the engine must do."""
        if not outputs and self.count_quiet_step():
            return StepUpdate()
        update = StepUpdate()
        self._step += 1
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

    def count_quiet_step(self) -> bool:
        """Count a step on which no worker reported anything, if that is all it takes: the usual step.

        ``False`` (nothing counted) when the step needs :meth:`update_connector_output`:
        a connector implements that hook, or has a transfer in flight, whose stall
        bound counts the reports. ``True``: the step is counted and there is nothing
        to apply (the empty :class:`StepUpdate`), so an engine may skip building one.
        Not among the monitored calls (:data:`~kvconn.host.MONITORED_CALLS`): such a
        step has no report to watch.
        """
        if self._impls["update_connector_output"] or self.awaits_reports:
            return False
        self._step += 1
        return True

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
        for req_id in [r for r, (step, since) in abandoned.items() if self._stalled(self._step - step, since)]:
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
                    self._abandoned[name][req_id] = (self._step, self.clock())
            elif load.is_async and req_id not in out.finished_recving:
                continue  # still loading
            del loads[req_id]
            if load.is_async:
                update.finished_recving.add(req_id)

    def _settle_sends(self, name: str, out: KVConnectorOutput, failed: bool, update: StepUpdate) -> None:
        """Free delayed blocks once every connector that delayed them is done.

        A worker side that raised is presumed to have lost its transfers: the
        frees it was delaying are released rather than leaked. So are those
        it has not reported within ``stall_steps`` steps and ``stall_s`` seconds (and it is failed):
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
            elif name in waiting:
                step, since = self._send_steps[req_id]
                if self._stalled(self._step - step, since):
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
                    f"{self._stall_bounds()}; their blocks are released"
                ),
            )

    def abandon_send(self, req_id: str) -> None:
        """Stop waiting for connectors to finish sending ``req_id`` (it was aborted)."""
        self._sending.pop(req_id, None)
        self._send_steps.pop(req_id, None)

    def pending_loads(self) -> dict[str, set[str]]:
        """Requests with a load in flight, per connector."""
        return {name: set(loads) for name, loads in self._loads.items()}

    def loads_in_flight(self, *, built_last: bool = False) -> dict[str, dict[str, LoadSpec]]:
        """Each connector's loads in flight, ``request id -> (block ids, is_async)``; connectors without any left out.

        ``built_last``: only those the workers act on in the step whose metadata was built last: every async load
        (it runs until it is reported) and the sync loads committed for that step. A sync load runs in the one worker
        step its metadata reaches; it stays in flight here until that step's report, which an engine that schedules
        ahead (vLLM's async scheduling) gets after it built the next step. An engine that tells its workers which
        blocks each connector loads, so that a worker whose connector failed reports them, lists these.
        """
        specs: dict[str, dict[str, LoadSpec]] = {}
        for name, loads in self._loads.items():
            if loads:
                picked = {
                    req_id: (load.block_ids, load.is_async)
                    for req_id, load in loads.items()
                    if not built_last or load.is_async or load.build == self._builds
                }
                if picked:
                    specs[name] = picked
        return specs

    def pending_load_blocks(self) -> dict[str, set[int]]:
        """Blocks of the loads in flight, per connector: the only ones it may report as failed to load."""
        return {name: {b for load in loads.values() for b in load.block_ids} for name, loads in self._loads.items()}
