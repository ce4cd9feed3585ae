"""A conformance driver over vLLM's scheduler, composed of the engine and an observer of the connector.

:class:`VllmSchedulerDriver` is the :class:`~kvconn.testing.conformance.SchedulerDriver` protocol over vLLM's
``Scheduler`` and a :class:`~.harness.VllmLoop` (the worker side of each step): requests in, steps, tables and
emptiness out. What it sees of the connector comes from a :class:`StepObserver`, of which there are two: the
adapter's kvconn hosts, for a kvconn plugin (:class:`~.host_observer.HostObserver`), and the connector's class,
for one of vLLM's own (:class:`~.native_observer.NativeObserver`). The data drivers add what the data checks
read (:class:`~.data_run.VllmDataRunDriver`).

Read by the four drivers (:mod:`.driver`, :mod:`.data_driver`, :mod:`.native_driver`, :mod:`.native_data`); a
change to the protocol's side here changes all four.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from kvconn.block_state import BlockIds
from kvconn.reference.shape import EngineShape
from kvconn.testing.conformance.diagnose import Awaited
from kvconn.testing.conformance.driver import NO_KEYS, DriverSpec, RequestKeys, StepRecord

from .harness import VLLM_TEST_SHAPE, VllmLoop, check_ranks, make_request

__all__ = ["Built", "StepObserver", "VllmSchedulerDriver", "vllm_shape"]

#: What a driver's observed ``build_connector_meta`` saw: the step's output, the connector's metadata (as
#: built), the requests the block state offered, and those it resolved.
Built = tuple[Any, Any, frozenset[str], list[str]]


def vllm_shape(shape: EngineShape) -> EngineShape:
    """A scenario's ``shape`` on the tiny model's KV shape (``max_model_len``: its positions), if its ranks can
    split the tiny model's heads."""
    check_ranks(shape)
    return shape.replace(
        max_model_len=2048, num_kv_heads=VLLM_TEST_SHAPE.num_kv_heads, head_dim=VLLM_TEST_SHAPE.head_dim
    )


class StepObserver(Protocol):
    """What a driver sees of the connector under test, and where it looks (see the module docstring)."""

    #: what the observed ``build_connector_meta`` saw this step (``None`` until vLLM calls it)
    built: Built | None

    def begin_step(self, withhold: frozenset[str]) -> None:
        """Before vLLM schedules a step: ``withhold`` is left out of the block state offered to the connector."""

    def record(self, loop: VllmLoop, built: Built, preempted: set[str], tables: dict[str, BlockIds]) -> StepRecord:
        """The step's record, from what was built, the requests preempted and the live tables at build time."""

    def finished_calls(self) -> dict[str, int]:
        """How many times the connector's ``request_finished`` ran, per request id."""

    def num_tracked_requests(self, loop: VllmLoop) -> dict[str, int]:
        """Per role, what the connector says it tracks."""

    def assert_empty(self) -> None:
        """Raise ``AssertionError`` naming what the connector still holds that the engine does not."""

    def close(self, loop: VllmLoop) -> None:
        """Shut the connector's two sides down."""


class VllmSchedulerDriver:
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over ``loop``'s vLLM scheduler, seen by ``observer``.

    ``spec`` sizes the pool (``block_size`` x ``num_blocks``); ``shape`` is the one the scheduler was built with.
    """

    def __init__(self, spec: DriverSpec, shape: EngineShape, loop: VllmLoop, observer: StepObserver) -> None:
        self.block_size, self.num_blocks = spec.shape.block_size, spec.shape.num_blocks
        self.shape = shape
        self.loop = loop
        self.scheduler = loop.scheduler
        self.observer = observer
        #: requests aborted while their async load was in flight, and the step before which each was aborted
        self._aborted_loading: dict[str, int] = {}

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int, keys: RequestKeys = NO_KEYS) -> None:
        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.block_size, **keys._asdict()))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        request = self.scheduler.requests.get(req_id)
        if (
            request is not None
            and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and req_id not in self.scheduler.finished_recving_kv_req_ids
        ):
            self._aborted_loading[req_id] = len(self.loop.outputs)
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def awaited(self) -> list[Awaited]:
        """The loads of aborted requests whose blocks vLLM still holds (see :func:`~kvconn.testing.conformance.
        diagnose.stall`): ``Scheduler.finish_requests`` keeps them until ``finished_recving`` reports the load."""
        answer = "its async load was in flight (it waited in WAITING_FOR_REMOTE_KVS)"
        held = self.scheduler.requests
        return [
            Awaited(req_id, "finished_recving", step, answer, ended=True)
            for req_id, step in self._aborted_loading.items()
            if req_id in held
        ]

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        """Run one step, withholding ``withhold`` from the block state; the observer records it."""
        self.observer.built = None
        self.observer.begin_step(frozenset(withhold))
        preemptions = self._preemptions()
        tables: dict[str, BlockIds] = {}
        self.loop.step(inspect=lambda _: tables.update(self._tables()))
        built = self.observer.built
        assert built is not None, "vLLM did not call build_connector_meta"
        return self.observer.record(self.loop, built, self._preempted(preemptions), tables)

    def _tables(self) -> dict[str, BlockIds]:
        """The live table of every request holding blocks."""
        manager = self.scheduler.kv_cache_manager
        tables = {r: manager.get_block_ids(r) for r in self.scheduler.requests}
        return {r: tuple(list(t) for t in table) for r, table in tables.items() if any(table)}

    def _preemptions(self) -> dict[str, int]:
        return {r: req.num_preemptions for r, req in self.scheduler.requests.items()}

    def _preempted(self, before: dict[str, int]) -> set[str]:
        """The requests preempted since ``before`` (:meth:`_preemptions`)."""
        requests = self.scheduler.requests
        return {r for r, n in before.items() if r in requests and requests[r].num_preemptions > n}

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def finished_calls(self) -> dict[str, int]:
        return self.observer.finished_calls()

    def num_tracked_requests(self) -> dict[str, int]:
        return self.observer.num_tracked_requests(self.loop)

    def assert_empty(self) -> None:
        scheduler = self.scheduler
        assert not scheduler.requests, f"requests still held by vLLM: {sorted(scheduler.requests)}"
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == self.num_blocks - 1, f"{self.num_blocks - 1 - free} blocks not returned to vLLM's pool"
        self.observer.assert_empty()

    def close(self) -> None:
        self.observer.close(self.loop)
