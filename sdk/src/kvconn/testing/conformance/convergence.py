"""A bound on connectors that keep an engine from making progress, with a message saying which and why.

vLLM re-asks a connector after an async load that failed with no valid prefix
(``Scheduler._update_waiting_for_remote_kv`` frees the request's blocks and it
is scheduled again), and so does the reference scheduler. A connector that
claims the block whose load failed again loads the same bad value again, for
ever: a real engine livelocks on it. :class:`ConvergenceWatch` watches the
scheduler-side host and raises :class:`NotConverging` once a request's load of
a block failed and the connector claimed that block again
:data:`REPEATS` times, or once an async load stays in flight for
:data:`LOAD_STEPS` steps and twice the wall-clock wait bound
(:func:`~.waits.wait_seconds`), instead of letting a data run spin to its step
limit. Twice: in a scenario, whose own stall check (a bound's worth of idle
steps) names the answer that started the wait, that check must come first on
any machine, and a load in flight starts no later than the idle steps it causes.
Steps and seconds both, because an idle step takes microseconds: a store behind
a socket on a loaded machine may need far more than :data:`LOAD_STEPS` of them
to finish a load that is merely slow.
(Frees never reported are bounded by the host's stall bound: its ``stall_steps`` and, as ``stall_s``, the
suite's wall-clock wait bound, so a free reported late but within that bound is no stall.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...filled import iter_block_ids
from ...host import CallOutcome, ConnectorHost, LoadPlan
from .results import ScenarioBroken
from .waits import raise_hint, wait_seconds

__all__ = ["LIVELOCK_FIX", "LOAD_STEPS", "REPEATS", "ConvergenceWatch", "NotConverging"]

#: Failed loads of one block a request may claim again before the run is stopped (an engine would loop forever).
REPEATS = 3
#: Steps an async load may stay in flight, once twice the wait bound has passed too (vLLM waits for ever).
LOAD_STEPS = 64

LIVELOCK_FIX = (
    "stop claiming a block whose load failed: when update_connector_output reports invalid_block_ids of a load "
    "in flight, remember those blocks (by block hash) and have get_num_new_matched_tokens claim only the tokens "
    "before the first of them (or drop the bad value from your store)"
)
LOAD_FIX = (
    "report every async load in finished_recving once it is done (or failed: report its blocks in "
    "get_block_ids_with_load_errors and the request in finished_recving), within a few steps"
)


class NotConverging(ScenarioBroken):
    """A run stopped because the connector would keep the engine from finishing a request."""


@dataclass
class _Load:
    blocks: dict[int, int]  # block id -> block index
    is_async: bool
    step: int
    since: float = field(default_factory=time.monotonic)


class ConvergenceWatch:
    """Watches connector ``name`` on a scheduler-side host; see the module docstring."""

    def __init__(self, name: str, block_size: int, engine: str) -> None:
        self.name, self.block_size, self.engine = name, block_size, engine
        self._step = 0
        self._answers: dict[str, tuple[int | None, bool]] = {}  # the last get_num_new_matched_tokens answer
        self._loads: dict[str, _Load] = {}
        self._failed: dict[str, int] = {}  # request -> index of its first block whose load failed
        self._repeats: dict[str, int] = {}

    def attach(self, host: ConnectorHost) -> None:
        calls = ("get_num_new_matched_tokens", "update_state_after_alloc", "update_connector_output")
        host.add_monitor(after=self._after, calls=calls)

    def _after(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if outcome.exception is not None:
            return
        if call == "get_num_new_matched_tokens":
            plan: LoadPlan = outcome.result
            self._answers[args[0].request_id] = (plan.num_tokens, plan.load_async)
        elif call == "update_state_after_alloc":
            request, block_ids, plan = args
            if outcome.result and plan.num_tokens:
                self._loaded(request, block_ids, plan)
        else:
            self._reported(args[0].get(self.name))

    def _loaded(self, request: Any, block_ids: Any, plan: LoadPlan) -> None:
        req_id, bs = request.request_id, self.block_size
        start, end = request.num_computed_tokens // bs, (request.num_computed_tokens + (plan.num_tokens or 0)) // bs
        failed = self._failed.get(req_id)
        if failed is None or not start <= failed < end:
            self._repeats.pop(req_id, None)
        else:
            repeats = self._repeats[req_id] = self._repeats.get(req_id, 0) + 1
            if repeats >= REPEATS:
                tokens, load_async = self._answers.get(req_id, (plan.num_tokens, plan.load_async))
                raise NotConverging(
                    f"request {req_id!r} never finishes: the load of its block {failed} failed (the worker reported "
                    f"it in invalid_block_ids), and get_num_new_matched_tokens claimed that block again, answering "
                    f"({tokens}, {load_async}) each time, {repeats} times in a row; the {self.engine} asks the "
                    "connector again after an async load that failed with no valid prefix (as vLLM's "
                    "Scheduler._update_waiting_for_remote_kv does), so a real engine loops on this request for ever",
                    LIVELOCK_FIX,
                )
        blocks = {b: i for i, _, b in iter_block_ids(block_ids, start, end)}
        self._loads[req_id] = _Load(blocks, plan.load_async, self._step)

    def _reported(self, out: Any) -> None:
        self._step += 1
        invalid = out.invalid_block_ids if out is not None else set()
        recving = out.finished_recving if out is not None else set()
        for req_id, load in list(self._loads.items()):
            hit = [i for b, i in load.blocks.items() if b in invalid]
            if hit:
                self._failed[req_id] = min(hit)
            if not load.is_async or req_id in recving or (out is not None and out.failed):
                del self._loads[req_id]
            elif self._step - load.step > LOAD_STEPS and time.monotonic() - load.since > 2 * wait_seconds():
                raise NotConverging(
                    f"request {req_id!r} never finishes: its async load of {len(load.blocks)} block(s) has not been "
                    f"reported in finished_recving for {self._step - load.step} steps and "
                    f"{time.monotonic() - load.since:.1f} s (get_finished), and the {self.engine} waits for it "
                    f"(vLLM waits for ever); {raise_hint()}",
                    LOAD_FIX,
                )
