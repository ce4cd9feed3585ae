"""A vLLM connector seen at the seam vLLM itself offers, its class: the native drivers' observer and engine.

vLLM builds, from its config, a subclass of the connector made here (:func:`_observed_class`) whose
``build_connector_meta``, ``request_finished`` and the other scheduler-side calls call the connector's own and
tell a :class:`NativeObserver` what they saw; vLLM's lazy block state is observed the way the kvconn drivers
observe theirs (:func:`~kvconn.testing.conformance.driver.observe_block_state`), and each step's metadata is
read as plain data (:mod:`.plain_view`) and as vLLM's ``MessageQueue`` would pickle it (:mod:`.wire`).
:func:`native_engine` builds vLLM's scheduler with that subclass, and the connector's worker (or its stand-in,
:mod:`.stand_ins`).

Read by the native drivers (:mod:`.native_driver`, :mod:`.native_data`) and :mod:`.native_session` (KV021 reads
:class:`NativeStepRecord`). The subclasses live in this module's namespace (vLLM imports them by module path).
"""

from __future__ import annotations

import itertools
import pickle
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvconn.block_state import BlockIds
from kvconn.outputs import KVConnectorOutput
from kvconn.reference.shape import EngineShape
from kvconn.testing.conformance.driver import (
    DriverSpec,
    HandedTable,
    ScenarioUnsupported,
    StepRecord,
    freeze,
    mutated_tables,
    observe_block_state,
)

from ..translate import translate_scheduler_output
from .harness import VllmLoop, make_scheduler
from .native_target import NativeTarget
from .plain_view import plain_view
from .scheduler_driver import Built, vllm_shape
from .stand_ins import stand_in_for
from .wire import UNPICKLABLE, MetadataDoesNotPickle, pickled_engine_objects

__all__ = ["NativeObserver", "NativeStepRecord", "SchedulerCallWatch", "native_engine"]


@dataclass
class NativeStepRecord(StepRecord):
    """A step of a vLLM connector: ``metadata`` is its :func:`plain_view`; ``engine_objects`` what pickling it met."""

    engine_objects: list[str] = field(default_factory=list)


class SchedulerCallWatch(Protocol):
    """What a data driver watches of the connector's scheduler-side calls (:class:`.native_data.SchedulerCalls`)."""

    def matched(self, request: Any, num_computed_tokens: int, result: tuple[int | None, bool]) -> None: ...

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    def reported(self, connector_output: Any) -> None: ...


_observed_ids = itertools.count()


def _observed_class(cls: Any, observer: NativeObserver) -> str:
    """A subclass of ``cls`` that records its scheduler-side calls for ``observer``; its name in this module.

    vLLM builds it from ``kv_connector`` / ``kv_connector_module_path`` like
    any connector; each override calls the connector's own method.
    """
    calls = observer.calls

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        observer.before_build(scheduler_output)
        metadata = cls.build_connector_meta(self, scheduler_output)
        observer.after_build(scheduler_output, metadata)
        return metadata

    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        return observer.finished(request, block_ids, lambda: cls.request_finished(self, request, block_ids))

    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        return observer.finished(request, block_ids, lambda: cls.request_finished_all_groups(self, request, block_ids))

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        result = cls.get_num_new_matched_tokens(self, request, num_computed_tokens)
        if calls is not None:
            calls.matched(request, num_computed_tokens, result)
        return result

    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        cls.update_state_after_alloc(self, request, blocks, num_external_tokens)
        if calls is not None:
            calls.allocated(request, blocks, num_external_tokens)

    def update_connector_output(self: Any, connector_output: Any) -> None:
        cls.update_connector_output(self, connector_output)
        if calls is not None:
            calls.reported(connector_output)

    name = f"_Observed{cls.__name__}{next(_observed_ids)}"
    namespace: dict[str, Any] = {
        "build_connector_meta": build_connector_meta,
        "request_finished": request_finished,
        "get_num_new_matched_tokens": get_num_new_matched_tokens,
        "update_state_after_alloc": update_state_after_alloc,
        "update_connector_output": update_connector_output,
        "__module__": __name__,
    }
    if hasattr(cls, "request_finished_all_groups"):
        namespace["request_finished_all_groups"] = request_finished_all_groups
    setattr(sys.modules[__name__], name, type(name, (cls,), namespace))
    return name


class NativeObserver:
    """The :class:`~.scheduler_driver.StepObserver` of a vLLM connector, told by its observed class.

    ``calls``: a data driver's watch on the scheduler-side calls (``None``: not watched).
    """

    def __init__(self, target: NativeTarget, calls: SchedulerCallWatch | None = None) -> None:
        self.target, self.calls = target, calls
        self.built: Built | None = None
        self._withhold: frozenset[str] = frozenset()
        self._resolved: list[str] = []
        self._handed: list[HandedTable] = []
        self._finished_calls: Counter[str] = Counter()
        self._finishing: set[str] = set()  # requests inside an observed request_finished call
        self._engine_objects: list[str] = []
        #: The loop the connector runs in, kept as long as the observed class (a module attribute: the whole
        #: process). vLLM's own connectors may hold ZMQ contexts their shutdown leaves open (the scheduler role of
        #: MooncakeStoreConnector keeps its LookupKeyClient's), and one finalised by the garbage collector while its
        #: socket is open blocks the process forever in ``Context.term``; kept alive, none is ever finalised.
        self.loop: VllmLoop | None = None

    def begin_step(self, withhold: frozenset[str]) -> None:
        self._withhold = withhold

    def before_build(self, scheduler_output: Any) -> None:
        self._resolved, self._handed = [], []
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None and hasattr(state, "req_ids"):  # the lazy form (vLLM 0.30+)
            observe_block_state(state, self._withhold, self._resolved, self._handed)
        for new in scheduler_output.scheduled_new_reqs:
            table = tuple(new.block_ids)
            self._handed.append((f"scheduled_new_reqs[{new.req_id!r}].block_ids", table, freeze(table)))

    def after_build(self, scheduler_output: Any, metadata: Any) -> None:
        self._engine_objects = pickled_engine_objects(metadata) if metadata is not None else []
        if self._engine_objects and self._engine_objects[-1].startswith(UNPICKLABLE):
            raise MetadataDoesNotPickle(
                f"vLLM's MessageQueue cannot pickle this metadata for the workers: {'; '.join(self._engine_objects)}"
            )
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None and hasattr(state, "req_ids"):
            offered = frozenset(state.req_ids)
        elif state is not None:  # vLLM 0.29: a dict of the requests that got new blocks
            offered = frozenset(state.block_ids)
        else:
            offered = frozenset()
        self.built = (scheduler_output, metadata, offered, self._resolved)

    def finished(self, request: Any, block_ids: Any, call: Callable[[], Any]) -> Any:
        """Count vLLM's call; a connector's request_finished_all_groups calling its own request_finished is one."""
        if request.request_id in self._finishing:
            return call()
        self._finished_calls[request.request_id] += 1
        table = tuple(block_ids) if block_ids and not isinstance(block_ids[0], int) else (block_ids,)
        self._handed.append((f"request_finished({request.request_id!r})'s block_ids", table, freeze(table)))
        self._finishing.add(request.request_id)
        try:
            return call()
        finally:
            self._finishing.discard(request.request_id)

    def record(self, loop: VllmLoop, built: Built, preempted: set[str], tables: dict[str, BlockIds]) -> StepRecord:
        scheduler_output, metadata, offered, resolved = built
        block_size = loop.block_size
        plain: Any = plain_view(metadata, block_size)  # stands where a kvconn Struct would (duck-typed)
        encoded = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL) if metadata is not None else None
        decoded: Any = plain_view(pickle.loads(encoded), block_size) if encoded is not None else None
        kv_output = loop.last_kv_output
        return NativeStepRecord(
            engine_objects=self._engine_objects,
            output=translate_scheduler_output(scheduler_output, len(loop.outputs)),
            metadata=plain,  # the block-id analysis reads plain data
            decoded=decoded,
            encoded=encoded,
            tables=tables,
            offered=offered,
            resolved=resolved,
            connector_output=KVConnectorOutput(
                finished_sending=set(getattr(kv_output, "finished_sending", None) or ()),
                finished_recving=set(getattr(kv_output, "finished_recving", None) or ()),
            ),
            preempted=preempted,
            mutated=mutated_tables(self._handed),
        )

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def num_tracked_requests(self, loop: VllmLoop) -> dict[str, int]:
        return {}  # vLLM connectors have no such count; KV032 reads the engine's own state

    def assert_empty(self) -> None:
        """Nothing to add: a vLLM connector's holdings are the engine's (its requests and blocks)."""

    def close(self, loop: VllmLoop) -> None:
        shutdown = getattr(loop.scheduler.connector, "shutdown", None)
        if callable(shutdown):
            shutdown()
        loop.shutdown()


def native_engine(
    spec: DriverSpec, observer: NativeObserver, worker_class: Callable[[type], type] = lambda cls: cls
) -> tuple[EngineShape, Any, Callable[[Any], Any]]:
    """vLLM's scheduler running ``observer``'s connector as its observed class, and how to build its workers.

    Returns the engine's shape, the scheduler and ``make_worker(config)``, which builds a rank's worker connector
    from that rank's vLLM config (of ``worker_class(cls)``, where ``cls`` is the connector's class or its stand-in
    worker's), as :class:`~.harness.VllmLoop` takes it. A shape with several KV-cache groups is refused
    (:class:`~kvconn.testing.conformance.driver.ScenarioUnsupported`) for a connector that is not SupportsHMA.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

    target = observer.target
    shape = vllm_shape(spec.shape)
    if len(spec.shape.kv_cache_groups) > 1 and not supports_hma(target.cls):
        raise ScenarioUnsupported(
            f"{target.cls.__name__} is not SupportsHMA: vLLM runs it only with one KV-cache group"
        )
    class_name = _observed_class(target.cls, observer)
    stand_in = stand_in_for(target.cls, spec.config)
    transfer = {
        "kv_connector": class_name,
        "kv_connector_module_path": __name__,
        "kv_connector_extra_config": {**(stand_in.config if stand_in else {}), **(spec.config or {})},
    }
    scheduler = make_scheduler(None, shape=shape, transfer_fields=transfer)
    stand_in_worker = stand_in.worker if stand_in is not None else None
    worker_cls = worker_class(stand_in_worker() if stand_in_worker is not None else target.cls)
    kv_cache_config = scheduler.kv_cache_config
    return shape, scheduler, lambda config: worker_cls(config, KVConnectorRole.WORKER, kv_cache_config)
