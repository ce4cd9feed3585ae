"""Load failures a conformance driver injects, at kvconn's host boundary, in any engine.

A driver attaches :class:`LoadFailures` to the connector's two hosts (a
scheduler-side and a worker-side :class:`~kvconn.host.ConnectorHost`, through
monitors) and to the worker's KV caches. When a load it picks lands, the
loaded block is overwritten with garbage and reported failed in the
connector's own ``get_finished`` report (``invalid_block_ids``), as a worker
that found a bad value would: the engine recovers as it does (the reference
scheduler, or vLLM's), and the connector's scheduler side learns of it in
``update_connector_output``.

Two modes:

* ``"first"``: the connector's first load fails in its last block, once;
* ``"persistent"``: the first block of the connector's first load is a
  corrupt value that stays in the store: every later load of a block with
  the same content (the same token prefix), by any request, fails too. Its
  valid prefix is the local hit (none, without prefix caching), so an engine
  that re-asks the connector after a failed async load (vLLM) gets the same
  claim again from a connector that does not remember the failure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ...context import NULL_BLOCK_ID
from ...host import CallOutcome, ConnectorHost, LoadPlan
from ...outputs import KVConnectorOutput
from .convergence import ConvergenceWatch

__all__ = ["GARBAGE", "FailureMode", "LoadFailures", "watch_data_run"]

#: What an injected failed load leaves in a block: far outside the model's KV range.
GARBAGE = 3.0

FailureMode = Literal["first", "persistent"]


@dataclass
class _Victim:
    """One load the injector makes fail: the blocks (group, id) of one block index of it."""

    req_id: str
    is_async: bool
    block_ids: list[tuple[int, int]]


class LoadFailures:
    """Makes chosen loads of connector ``name`` fail; see the module docstring.

    ``kv_caches`` are the worker's per-layer tensors (axis 0: the block id)
    and ``group_of_layer`` maps each layer to its KV-cache group.
    """

    def __init__(
        self,
        name: str,
        mode: FailureMode,
        *,
        block_size: int,
        kv_caches: Mapping[str, Any],
        group_of_layer: Mapping[str, int],
    ) -> None:
        self.name, self.mode, self.block_size = name, mode, block_size
        self.kv_caches, self.group_of_layer = kv_caches, group_of_layer
        #: loads failed so far
        self.failed = 0
        #: the block ids the last ``get_finished`` reported failed for the injector
        self.failed_blocks: set[int] = set()
        self._key: tuple[int, ...] | None = None  # "persistent": the token prefix of the corrupt block
        self._sync: list[_Victim] = []  # failing in the worker step that follows the schedule
        self._async: dict[str, _Victim] = {}  # failing when their load is reported finished

    def attach(self, scheduler: ConnectorHost, worker: ConnectorHost) -> None:
        """Watch the loads the scheduler side commits and fail them on the worker side."""
        scheduler.add_monitor(after=self._after_alloc, calls="update_state_after_alloc")
        worker.add_monitor(after=self._after_worker_call, calls=("wait_for_layer_load", "get_finished"))

    def _after_alloc(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        request, block_ids, plan = args
        if outcome.exception is not None or not outcome.result or not plan.num_tokens:
            return
        index = self._victim_index(request, plan)
        if index is None:
            return
        blocks = [(g, t[index]) for g, t in enumerate(block_ids) if index < len(t) and t[index] != NULL_BLOCK_ID]
        victim = _Victim(request.request_id, plan.load_async, blocks)
        if plan.load_async:
            self._async[victim.req_id] = victim
        else:
            self._sync.append(victim)

    def _victim_index(self, request: Any, plan: LoadPlan) -> int | None:
        """The block index of this load to fail, or ``None``."""
        bs = self.block_size
        first = request.num_computed_tokens // bs
        end = (request.num_computed_tokens + (plan.num_tokens or 0)) // bs
        if self.mode == "first":
            if self.failed or self._sync or self._async:
                return None
            return end - 1
        tokens: Sequence[int] = request.all_token_ids
        if self._key is None:
            self._key = tuple(tokens[: (first + 1) * bs])
        index = len(self._key) // bs - 1
        if first <= index < end and tuple(tokens[: len(self._key)]) == self._key:
            return index
        return None

    def _after_worker_call(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if outcome.exception is not None:
            return
        if call == "wait_for_layer_load":  # a sync load's layer is in place: overwrite what it loaded
            for victim in self._sync:
                self._corrupt(victim, [args[0]])
            return
        out = outcome.result.get(self.name)  # get_finished: the step's end
        failing, self._sync = self._sync, []
        for req_id in sorted(out.finished_recving & self._async.keys()) if out is not None else ():
            victim = self._async.pop(req_id)
            self._corrupt(victim, list(self.group_of_layer))
            failing.append(victim)
        self.failed_blocks = {b for victim in failing for _, b in victim.block_ids}
        if failing:
            out = outcome.result.setdefault(self.name, KVConnectorOutput())
            for victim in failing:
                out.invalid_block_ids |= {b for _, b in victim.block_ids}
            self.failed += len(failing)

    def _corrupt(self, victim: _Victim, layers: Sequence[str]) -> None:
        for layer in layers:
            for group, block_id in victim.block_ids:
                if self.group_of_layer[layer] == group:
                    self.kv_caches[layer][block_id].fill_(GARBAGE)


def watch_data_run(
    name: str,
    fail_loads: FailureMode | None,
    *,
    engine: str,
    block_size: int,
    hosts: tuple[ConnectorHost, ConnectorHost],
    kv_caches: Mapping[str, Any],
    group_of_layer: Mapping[str, int],
) -> LoadFailures | None:
    """What a data driver adds at its ``(scheduler, worker)`` hosts: the failures asked for, and a convergence watch.

    Returns the injector (``None`` without ``fail_loads``); ``engine`` names the engine in the watch's messages.
    """
    failures = None
    if fail_loads is not None:
        failures = LoadFailures(
            name, fail_loads, block_size=block_size, kv_caches=kv_caches, group_of_layer=group_of_layer
        )
        failures.attach(*hosts)
    ConvergenceWatch(name, block_size, engine).attach(hosts[0])
    return failures
