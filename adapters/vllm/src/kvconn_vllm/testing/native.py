"""The conformance suite for vLLM's own connectors (``KVConnectorBase_V1`` subclasses), through vLLM's scheduler.

``kvconn validate --engine vllm --vllm-connector NAME`` judges a connector
that is not a kvconn plugin: a name in vLLM's ``KVConnectorFactory``
(``ExampleConnector``, ``MooncakeStoreConnector``...) or
``"pkg.module:Class"``. :func:`run_native_conformance` plays the same
scenarios as every other driver through vLLM's real ``Scheduler`` (the
harness of :mod:`.harness`), the connector configured as vLLM configures it
(``kv_connector`` + ``kv_connector_module_path``, the config as its
``kv_connector_extra_config``), and runs the checks that apply to a vLLM
connector. Those that do not apply are reported skipped with the reason
(:data:`NOT_APPLICABLE`).

Seams, none of them in vLLM's scheduler or model runner:

* **the connector.** vLLM builds, from its config, a subclass made here
  (:func:`_observed_class`) whose ``build_connector_meta`` and
  ``request_finished`` call the connector's own and record what they saw;
  vLLM's lazy block state is observed the way the kvconn drivers observe
  theirs (:func:`~kvconn.testing.conformance.driver.observe_block_state`).
* **the worker.** The connector's own worker runs through vLLM's
  ``KVConnectorModelRunnerMixin`` on fake KV tensors (:class:`.harness.VllmLoop`).
  A worker that cannot run without CUDA is replaced by a stand-in worker
  connector that reports completions as the real one does, or runs on a stand-in
  at a seam of its own (``OffloadingConnector``: an ``OffloadingSpec``,
  :mod:`.offloading_standin`) (:data:`STAND_IN_WORKERS`), and the report says so.
* **the wire.** Metadata crosses as vLLM's ``MessageQueue`` sends it, with
  ``pickle``; a pickler that watches every object (:func:`pickled_engine_objects`)
  reports the block state, the cache manager, a request or the scheduler
  output found in it (the seed's serialization concern).
"""

from __future__ import annotations

import itertools
import pickle
import sys
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

from kvconn.errors import ConnectorLoadError
from kvconn.outputs import KVConnectorOutput
from kvconn.testing.conformance import ConnectorReport, run_session
from kvconn.testing.conformance.catalog import Check
from kvconn.testing.conformance.checks.data import failed_load_recomputed
from kvconn.testing.conformance.driver import (
    DriverSpec,
    HandedTable,
    ScenarioUnsupported,
    StepRecord,
    freeze,
    mutated_tables,
    observe_block_state,
)
from kvconn.testing.conformance.results import CheckResult, Violation
from kvconn.testing.conformance.session import Session

from .scheduler_driver import VllmSchedulerMethods

__all__ = [
    "NOT_APPLICABLE",
    "STAND_IN_WORKERS",
    "StandIn",
    "NativeDriver",
    "NativeSession",
    "NativeStepRecord",
    "MetadataDoesNotPickle",
    "UNPICKLABLE",
    "NativeTarget",
    "native_target",
    "pickled_engine_objects",
    "plain_view",
    "run_native_conformance",
    "stand_in_for",
]

_PACKAGING = "a kvconn packaging check (entry points, a msgspec Config, pluggy hooks); a vLLM connector has none"
#: Checks that do not apply to a vLLM connector, and why (reported as skipped with this reason).
NOT_APPLICABLE: dict[str, str] = {
    "KV001": _PACKAGING,
    "KV002": _PACKAGING,
    "KV003": _PACKAGING,
    "KV004": _PACKAGING,
    "KV005": _PACKAGING,
    "KV006": _PACKAGING,
    "KV013": "a kvconn-only contract (an engine may offer fewer requests than it schedules): vLLM offers every "
    "scheduled request",
    "KV020": "kvconn's msgspec round trip; a vLLM connector's metadata crosses with pickle, checked by KV021",
}
#: Why the data checks do not apply to a connector run with a stand-in worker.
_STAND_IN_DATA = "its worker here is a stand-in that moves no KV, so the data checks have nothing to judge"

#: vLLM's lazy block state (0.30+) has ``req_ids``; 0.29's is a dict of the requests that got new blocks.
_ENGINE_OBJECTS = {
    "vllm.v1.core.sched.output.KVConnectorBlockState": "the KVConnectorBlockState (scheduler-local: it holds "
    "the KV cache manager's resolver, or tables of this step only)",
    "vllm.v1.core.sched.output.SchedulerOutput": "the SchedulerOutput",
    "vllm.v1.core.kv_cache_manager.KVCacheManager": "the KVCacheManager",
    "vllm.v1.core.block_pool.BlockPool": "the BlockPool",
    "vllm.v1.request.Request": "a Request",
    "vllm.v1.core.sched.scheduler.Scheduler": "the Scheduler",
}


@dataclass(frozen=True)
class NativeTarget:
    """A vLLM connector to validate: how vLLM's config names it, and its class."""

    name: str
    cls: type
    kv_connector: str
    module_path: str | None


def native_target(name: str) -> NativeTarget:
    """``name`` in vLLM's ``KVConnectorFactory``, or ``"pkg.module:Class"``; :class:`ConnectorLoadError` otherwise."""
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    module_path, _, class_name = name.rpartition(":")
    if module_path:
        try:
            cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConnectorLoadError(f"cannot import vLLM connector {name!r}: {type(exc).__name__}: {exc}") from None
    else:
        registry = KVConnectorFactory._registry
        if name not in registry:
            raise ConnectorLoadError(
                f"no connector named {name!r} in this vLLM's KVConnectorFactory "
                f"(known: {', '.join(sorted(registry))}); or give 'package.module:Class'"
            )
        cls = registry[name]()
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ConnectorLoadError(f"{name!r} is {cls!r}, not a KVConnectorBase_V1 subclass")
    return NativeTarget(name, cls, class_name if module_path else name, module_path or None)


# ------------------------------------------------------------------ the wire


def pickled_engine_objects(obj: object) -> list[str]:
    """Pickle ``obj`` as vLLM's ``MessageQueue`` does; the scheduler-side objects found on the way.

    A metadata that cannot pickle is reported too (vLLM would fail the step).
    """
    found: list[str] = []
    failure: list[str] = []

    class Watcher(pickle.Pickler):
        def reducer_override(self, value: Any) -> Any:
            key = f"{type(value).__module__}.{type(value).__qualname__}"
            if key in _ENGINE_OBJECTS:
                found.append(_ENGINE_OBJECTS[key])
            return NotImplemented

    import io

    try:
        Watcher(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:
        failure.append(f"{UNPICKLABLE} ({type(exc).__name__}: {str(exc)[:200]})")
    return sorted(set(found)) + failure


#: How :func:`pickled_engine_objects` says the metadata does not pickle at all (its last entry).
UNPICKLABLE = "it does not pickle"


class MetadataDoesNotPickle(Exception):
    """Raised from the observed ``build_connector_meta``: vLLM could not send this metadata to its workers."""


def plain_view(obj: object, block_size: int) -> object:
    """``obj`` as the plain data the block-id analysis reads: dataclasses and objects as dicts, tensors as lists.

    A field named for slots (vLLM's ``slot_mapping``) holds ``block * block_size + offset``: it becomes the block
    ids it covers, so the checks compare them with the live tables. vLLM's KV-offloading specs are read by type
    (:func:`_offloading_spec`).
    """
    return _plain(obj, block_size, "", set())


def _offloading_spec(obj: object) -> dict[str, Any] | None:
    """A spec of vLLM's KV offloading (``vllm.v1.kv_offload.base.LoadStoreSpec``) as plain data; ``None`` if not one.

    ``GPULoadStoreSpec.block_ids`` are the engine's blocks (its ``block_indices``, each group's position in the
    request, become ``first_block_index``); any other spec addresses the offloaded medium (``CPULoadStoreSpec``:
    chunks of the CPU cache), so its ids become ``offloaded_chunk_index``, which the block-id analysis leaves out.
    """
    names = {(k.__module__, k.__name__) for k in type(obj).__mro__}
    base = "vllm.v1.kv_offload.base"
    if (base, "LoadStoreSpec") not in names:
        return None
    ids = getattr(obj, "block_ids", None)
    if (base, "GPULoadStoreSpec") not in names:
        return {"offloaded_chunk_index": ids}
    return {"block_ids": ids, "group_sizes": obj.group_sizes, "first_block_index": obj.block_indices}  # type: ignore[attr-defined]


def _plain(obj: object, block_size: int, name: str, seen: set[int]) -> object:
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if id(obj) in seen:
        return None
    seen = seen | {id(obj)}
    tolist = getattr(obj, "tolist", None)
    if callable(tolist) and type(obj).__module__.startswith(("torch", "numpy")):
        obj = tolist()
        if "slot" in name and isinstance(obj, list) and all(isinstance(i, int) for i in obj):
            return sorted({i // block_size for i in obj})
        return obj if not isinstance(obj, list) else [_plain(i, block_size, name, seen) for i in obj]
    if isinstance(obj, Mapping):
        return {
            k if isinstance(k, (str, int)) else repr(k): _plain(v, block_size, str(k), seen) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(i, block_size, name, seen) for i in obj]
    spec = _offloading_spec(obj)
    if spec is not None:
        return _plain(spec, block_size, name, seen)
    if is_dataclass(obj) and not isinstance(obj, type):
        items = {f.name: getattr(obj, f.name) for f in fields(obj)}
    else:
        items = {k: v for k, v in vars(obj).items() if not k.startswith("_")} if hasattr(obj, "__dict__") else {}
    return {k: _plain(v, block_size, k, seen) for k, v in items.items()}


# ------------------------------------------------------------------ stand-in workers


def _mooncake_store_stand_in() -> type:
    """A worker for ``MooncakeStoreConnector`` that reports what its real worker reports, moving no data.

    Derived from vLLM's ``MooncakeStoreWorker``: each save job of the step's
    metadata (``ReqMeta.can_save``, numbered ``store_job_id`` by the
    scheduler side) is reported done in ``MooncakeStoreWorkerMetadata.completed_saves``
    (``build_connector_worker_meta``, one rank), and each async load
    (``load_spec.can_load``) in ``get_finished``'s finished receiving, on the
    step after it started, as its receive threads do. The real worker copies
    through ``torch.cuda.Event`` and a ``MooncakeDistributedStore``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata

    class MooncakeStoreStandInWorker(KVConnectorBase_V1):
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self._saves: dict[int, int] = {}
            self._recving: set[str] = set()
            self._recved: set[str] = set()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            for req in self._get_connector_metadata().requests:
                if req.load_spec is not None and req.load_spec.can_load:
                    self._recving.add(req.req_id)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            for req in self._get_connector_metadata().requests:
                if req.can_save and req.store_job_id is not None:
                    self._saves[req.store_job_id] = 1

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            done, self._recved, self._recving = self._recved, self._recving, set()
            return None, done or None

        def build_connector_worker_meta(self) -> Any:
            saves, self._saves = self._saves, {}
            return MooncakeStoreWorkerMetadata(completed_saves=saves) if saves else None

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            raise NotImplementedError  # worker role only

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            raise NotImplementedError

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            raise NotImplementedError

    return MooncakeStoreStandInWorker


@dataclass(frozen=True)
class StandIn:
    """A stand-in for a worker that cannot run here: why, what stands in, and the config it needs.

    ``worker`` builds a worker connector that replaces the connector's own
    (it moves no KV: the data checks do not apply). ``None``: the connector's
    own worker runs, on a stand-in that ``config`` plugs in at a seam vLLM
    offers (``moves_kv``: it copies real KV, so the data checks apply).
    """

    why: str
    worker: Callable[[], type] | None
    #: config defaults under the stand-in (a user's config wins), with what they leave out
    config: Mapping[str, Any] = field(default_factory=dict)
    leaves_out: str = ""
    #: the report's words for what stands in (default: the stand-in worker's class name)
    describes: str = ""
    moves_kv: bool = False
    #: config keys with which a user picks their own instead (then the stand-in is not used)
    overridden_by: tuple[str, ...] = ()

    def note(self) -> str:
        """The report's ``note:`` line."""
        what = self.describes or (
            f"a stand-in ({self.worker().__name__}) that reports completions as the real one does"
            if self.worker is not None
            else "a stand-in"
        )
        return (
            f"worker: {what}; the real one cannot run here: {self.why}"
            + ("" if self.moves_kv else "; the checks judge the scheduler side")
            + (f"; {self.leaves_out}" if self.leaves_out else "")
        )


#: ``OffloadingConnector``'s config for its stand-in spec (:mod:`.offloading_standin`); ``cpu_bytes_to_use``:
#: room for every block the conformance runs save, so nothing is evicted.
_OFFLOADING_STAND_IN = {
    "spec_name": "CPUStandInOffloadingSpec",
    "spec_module_path": "kvconn_vllm.testing.offloading_standin",
    "cpu_bytes_to_use": 32 * 1024 * 1024,
}

#: Connector class names whose worker cannot run here, and what stands in for it.
STAND_IN_WORKERS: dict[str, StandIn] = {
    "MooncakeStoreConnector": StandIn(
        "its worker copies through torch.cuda.Event and a MooncakeDistributedStore (CUDA and a Mooncake master)",
        _mooncake_store_stand_in,
        {"enable_lookup": False},
        "lookups go to the real worker's ZMQ lookup server, so enable_lookup is off: saves are judged, loads are not",
    ),
    "OffloadingConnector": StandIn(
        "CPUOffloadingSpec.get_worker needs CUDA or XPU (its CPUOffloadingWorker copies through CUDA streams "
        "and events)",
        None,
        _OFFLOADING_STAND_IN,
        describes="vLLM's own OffloadingConnector worker and CPUOffloadingManager, on a stand-in spec "
        "(CPUStandInOffloadingSpec, kvconn_vllm.testing.offloading_standin, plugged in by spec_name and "
        "spec_module_path as vLLM's own tests plug in theirs): vLLM's CPUOffloadingSpec whose worker makes "
        "CPUOffloadingWorker's block copies on the CPU, at submission",
        moves_kv=True,
        overridden_by=("spec_name", "spec_module_path"),
    ),
}


def stand_in_for(cls: type, config: Mapping[str, Any] | None = None) -> StandIn | None:
    """What stands in for the worker of ``cls`` (or of the vLLM connector it subclasses) under the user's
    ``config``, if its worker needs a stand-in and the config does not pick its own."""
    for klass in cls.__mro__:
        if klass.__name__ in STAND_IN_WORKERS and klass.__module__.startswith("vllm."):
            stand_in = STAND_IN_WORKERS[klass.__name__]
            return None if any(key in (config or {}) for key in stand_in.overridden_by) else stand_in
    return None


# ------------------------------------------------------------------ the driver


@dataclass
class NativeStepRecord(StepRecord):
    """A step of a vLLM connector: ``metadata`` is its :func:`plain_view`; ``engine_objects`` what pickling it met."""

    engine_objects: list[str] = field(default_factory=list)


_observed_ids = itertools.count()


def _observed_class(cls: Any, driver: NativeDriver) -> str:
    """A subclass of ``cls`` that records its scheduler-side calls for ``driver``; its name in this module.

    vLLM builds it from ``kv_connector`` / ``kv_connector_module_path`` like
    any connector; each override calls the connector's own method.
    """

    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        driver._before_build(scheduler_output)
        metadata = cls.build_connector_meta(self, scheduler_output)
        driver._after_build(scheduler_output, metadata)
        return metadata

    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        return driver._finished(request, block_ids, lambda: cls.request_finished(self, request, block_ids))

    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        return driver._finished(request, block_ids, lambda: cls.request_finished_all_groups(self, request, block_ids))

    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        result = cls.get_num_new_matched_tokens(self, request, num_computed_tokens)
        if driver.calls is not None:
            driver.calls.matched(request, num_computed_tokens, result)
        return result

    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        cls.update_state_after_alloc(self, request, blocks, num_external_tokens)
        if driver.calls is not None:
            driver.calls.allocated(request, blocks, num_external_tokens)

    def update_connector_output(self: Any, connector_output: Any) -> None:
        cls.update_connector_output(self, connector_output)
        if driver.calls is not None:
            driver.calls.reported(connector_output)

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


class NativeDriver(VllmSchedulerMethods):
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over vLLM's scheduler for a vLLM connector."""

    #: the data driver's watch on the scheduler-side calls (:class:`.native_data.SchedulerCalls`)
    calls: Any = None

    def __init__(self, spec: DriverSpec, target: NativeTarget) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

        from .harness import VLLM_TEST_SHAPE, check_ranks, make_scheduler

        check_ranks(spec.shape)
        if len(spec.shape.kv_cache_groups) > 1 and not supports_hma(target.cls):
            raise ScenarioUnsupported(
                f"{target.cls.__name__} is not SupportsHMA: vLLM runs it only with one KV-cache group"
            )
        self.block_size, self.num_blocks = spec.shape.block_size, spec.shape.num_blocks
        self._withhold: frozenset[str] = frozenset()
        self._built = None
        self._resolved: list[str] = []
        self._handed: list[HandedTable] = []
        self._finished_calls: Counter[str] = Counter()
        self._finishing: set[str] = set()  # requests inside an observed request_finished call
        self._engine_objects: list[str] = []
        class_name = _observed_class(target.cls, self)
        stand_in = stand_in_for(target.cls, spec.config)
        transfer = {
            "kv_connector": class_name,
            "kv_connector_module_path": __name__,
            "kv_connector_extra_config": {**(stand_in.config if stand_in else {}), **(spec.config or {})},
        }
        self.shape = spec.shape.replace(
            max_model_len=2048, num_kv_heads=VLLM_TEST_SHAPE.num_kv_heads, head_dim=VLLM_TEST_SHAPE.head_dim
        )
        self.scheduler = make_scheduler(None, shape=self.shape, transfer_fields=transfer)
        stand_in_worker = stand_in.worker if stand_in is not None else None
        worker_cls = self._worker_class(stand_in_worker() if stand_in_worker is not None else target.cls)
        kv_cache_config = self.scheduler.kv_cache_config
        self.loop = self._make_loop(lambda config: worker_cls(config, KVConnectorRole.WORKER, kv_cache_config))

    def _worker_class(self, cls: type) -> type:
        """The worker-side class to run (the data driver's watches its calls)."""
        return cls

    def _make_loop(self, make_worker: Callable[[Any], Any]) -> Any:
        """The loop that runs the worker side of each step (the data driver's has a model); ``make_worker(config)``
        builds a rank's worker from that rank's vLLM config."""
        from .harness import VllmLoop

        return VllmLoop(self.scheduler, make_worker=make_worker)

    # ---------------------------------------------------------------- observation (from the connector subclass)

    def _before_build(self, scheduler_output: Any) -> None:
        self._resolved, self._handed = [], []
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is not None and hasattr(state, "req_ids"):  # the lazy form (vLLM 0.30+)
            observe_block_state(state, self._withhold, self._resolved, self._handed)
        for new in scheduler_output.scheduled_new_reqs:
            table = tuple(new.block_ids)
            self._handed.append((f"scheduled_new_reqs[{new.req_id!r}].block_ids", table, freeze(table)))

    def _after_build(self, scheduler_output: Any, metadata: Any) -> None:
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
        self._built = (scheduler_output, metadata, offered, self._resolved)

    def _finished(self, request: Any, block_ids: Any, call: Callable[[], Any]) -> Any:
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

    # ---------------------------------------------------------------- protocol

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        from ..translate import translate_scheduler_output

        (scheduler_output, metadata, offered, resolved), preempted, tables = self._play_step(withhold)
        plain: Any = plain_view(metadata, self.block_size)  # stands where a kvconn Struct would (duck-typed)
        encoded = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL) if metadata is not None else None
        decoded: Any = plain_view(pickle.loads(encoded), self.block_size) if encoded is not None else None
        kv_output = self.loop.last_kv_output
        return NativeStepRecord(
            engine_objects=self._engine_objects,
            output=translate_scheduler_output(scheduler_output, len(self.loop.outputs)),
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

    def num_tracked_requests(self) -> dict[str, int]:
        return {}  # vLLM connectors have no such count; KV032 reads the engine's own state

    def close(self) -> None:
        shutdown = getattr(self.scheduler.connector, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.loop.shutdown()


# ------------------------------------------------------------------ the session


class _NativeFactory:
    """A session's drivers for a vLLM connector: :class:`NativeDriver`, and the data checks' (``data_driver``)."""

    def __init__(self, target: NativeTarget) -> None:
        self.target = target

    def __call__(self, spec: DriverSpec) -> NativeDriver:
        return NativeDriver(spec, self.target)

    def data_driver(self, spec: DriverSpec, **options: Any) -> Any:
        """:class:`~.native_data.NativeDataDriver` (``options``: its keywords)."""
        from .native_data import NativeDataDriver

        return NativeDataDriver(spec, self.target, **options)


class NativeSession(Session):
    """A :class:`~kvconn.testing.conformance.session.Session` for a vLLM connector.

    Serves both roles. A vLLM connector does not say whether it saves and
    loads: the data checks run on it (their data runs need both) unless its
    worker is a stand-in that moves no KV (:data:`STAND_IN_WORKERS`).
    """

    def __init__(self, target: NativeTarget, config: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.connector = target.name
        self.config = dict(config) if config is not None else None
        self.config_factory = None
        self.driver_name = "vllm"
        self.factory = _NativeFactory(target)
        self.cls = target.cls
        self.config_error = None
        self.stand_in = stand_in_for(target.cls, self.config)
        self.every_data_run_loads = False  # see Session.every_data_run_loads
        moves_kv = self.stand_in is None or self.stand_in.moves_kv
        self.capabilities = frozenset({"scheduler", "worker", *(("saves", "loads") if moves_kv else ())})
        self._memo = {}
        self._results = {}
        self._root = None

    def _run(self, check: Check) -> CheckResult:
        reason = NOT_APPLICABLE.get(check.id)
        if reason is None and "saves" in check.requires and "saves" not in self.capabilities:
            reason = _STAND_IN_DATA
        if reason is not None:
            return CheckResult(check.id, check.name, "skipped", f"does not apply to a vLLM connector: {reason}")
        if "saves" in check.requires:  # after the scenarios: a connector that cannot start fails KV010 alone
            check = replace(check, after=(*check.after, "KV010"))
        if check.id == "KV041":  # its second part reruns the worker as a kvconn plugin in a process of its own
            check = replace(check, function=failed_load_recomputed)
        if check.id == "KV021":  # pickled, not msgspec: the objects pickling met, not the plain view's types
            check = replace(check, function=_metadata_pickles_plain)
        if check.id == "KV011" and not _lazy_block_state():
            check = replace(check, fix=f"{check.fix}. {_DICT_FORM_FIX}")
        return super()._run(check)


_DICT_FORM_FIX = (
    "This vLLM's kv_connector_block_state.block_ids holds only the requests that got new blocks this step, so "
    "a connector reading it finds no table on the block-fill step: use vLLM 0.30 or later (its lazy block state "
    "offers every scheduled request), or keep each request's table from scheduled_new_reqs and new_block_ids"
)


def _lazy_block_state() -> bool:
    """Whether this vLLM's block state is the lazy form (0.30+: ``req_ids``), not 0.29's dict."""
    from vllm.v1.core.sched.output import KVConnectorBlockState

    return "req_ids" in getattr(KVConnectorBlockState, "__annotations__", {})


def _metadata_pickles_plain(session: Session) -> None:
    """KV021 for a vLLM connector: no scheduler-side object in the metadata vLLM pickles for its workers."""
    for trace in session.completed_traces():
        for record in trace.records:
            found = record.engine_objects if isinstance(record, NativeStepRecord) else []
            if found:
                raise Violation(
                    f"in {trace.where()}, step {record.step}: the metadata vLLM pickles for the workers holds "
                    f"{'; '.join(found)}"
                )


def run_native_conformance(
    name: str,
    *,
    config: Mapping[str, Any] | None = None,
    select: str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ConnectorReport:
    """Every check that applies to the vLLM connector ``name``, through vLLM's scheduler; never raises."""
    from .driver import load_driver

    try:
        load_driver()
        target = native_target(name)
    except Exception as exc:
        return ConnectorReport(name, [], load_error=str(exc))
    session = NativeSession(target, config)
    report = run_session(session, select=select, on_result=on_result)
    if session.stand_in is not None:
        report.notes.append(session.stand_in.note())
    return report
