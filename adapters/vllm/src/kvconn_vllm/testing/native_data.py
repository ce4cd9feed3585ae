"""The data checks (KV040-KV049) for vLLM's own connectors: their worker, vLLM's scheduler, a model that reads KV.

:class:`NativeDataDriver` is a :class:`~.data_run.VllmDataRunDriver` over the native drivers' engine
(:func:`~.native_observer.native_engine`) with the data drivers' model (:class:`~.model_loop.ModelLoop`): the
connector's own worker runs through vLLM's model-runner code on the CPU KV caches the model writes and reads, so
a wrong, stale or missing load changes the tokens, which must be the reference engine's. vLLM recovers from failed
loads as it does.

A vLLM connector has no kvconn host, so the driver watches it at the seam
vLLM itself offers, the connector class: subclasses made here
(:func:`observed_worker`) and in :mod:`.native_observer` call the connector's own methods and report each call to
a :class:`MonitorPoint`, which takes the monitors of
:mod:`kvconn.testing.conformance.fault_injection` (injected failed loads, reported
through the worker's ``get_block_ids_with_load_errors``) and
:mod:`~kvconn.testing.conformance.convergence` as a ``ConnectorHost`` does,
the vLLM calls translated into kvconn's shapes (:class:`SchedulerCalls`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvconn.host import CallOutcome, LoadPlan, MonitorAfter
from kvconn.outputs import KVConnectorOutput
from kvconn.testing.conformance.driver import DriverSpec
from kvconn.testing.conformance.fault_injection import FailureMode, watch_data_run

from ..translate import VllmRequestView, to_block_ids
from .data_run import VllmDataRunDriver
from .model_loop import ModelLoop
from .native_observer import NativeObserver, native_engine
from .native_target import NativeTarget

__all__ = ["MonitorPoint", "NativeDataDriver", "SchedulerCalls", "observed_worker"]


class MonitorPoint:
    """Monitors of a vLLM connector's calls, added as on a :class:`~kvconn.host.ConnectorHost` (``after`` only)."""

    def __init__(self) -> None:
        self._monitors: list[tuple[frozenset[str], MonitorAfter]] = []

    def add_monitor(
        self, before: Any = None, after: MonitorAfter | None = None, *, calls: str | Iterable[str] = ()
    ) -> None:
        if before is not None:
            raise NotImplementedError("a vLLM connector's calls are watched after they ran only")
        if after is not None:
            self._monitors.append((frozenset({calls} if isinstance(calls, str) else calls), after))

    def notify(self, call: str, args: tuple[Any, ...], result: Any) -> Any:
        """Tell the monitors of ``call``; returns ``result`` (which a monitor may have changed in place)."""
        outcome = CallOutcome(result)
        for calls, after in self._monitors:
            if call in calls:
                after(call, args, outcome)
        return outcome.result


class SchedulerCalls:
    """The scheduler-side calls of a vLLM connector, in kvconn's shapes, for a :class:`MonitorPoint`."""

    def __init__(self, name: str, point: MonitorPoint) -> None:
        self.name, self.point = name, point
        self._plans: dict[str, tuple[int, bool]] = {}  # request -> (local hit, load_async) of its last lookup
        self._loading: dict[str, set[int]] = {}  # request -> the blocks of its last load

    def matched(self, request: Any, num_computed_tokens: int, result: tuple[int | None, bool]) -> None:
        tokens, load_async = result
        self._plans[request.request_id] = (num_computed_tokens, bool(load_async))
        self.point.notify(
            "get_num_new_matched_tokens",
            (VllmRequestView(request), num_computed_tokens),
            LoadPlan(tokens, bool(load_async), self.name),
        )

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local, load_async = self._plans.pop(request.request_id, (request.num_computed_tokens, False))
        plan = LoadPlan(num_external_tokens, load_async, self.name if num_external_tokens else None)
        view = VllmRequestView(request, num_computed_tokens=local)
        block_ids = to_block_ids(blocks.get_block_ids())
        if num_external_tokens:
            self._loading[request.request_id] = {b for group in block_ids for b in group}
        self.point.notify("update_state_after_alloc", (view, block_ids, plan), True)

    def reported(self, connector_output: Any) -> None:
        """A request in ``failed_recving`` (vLLM's per-request failed load, with several KV-cache groups) is
        reported as the blocks of its load, kvconn's shape for a failed load."""
        invalid = set(connector_output.invalid_block_ids or ())
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            invalid |= self._loading.get(req_id, set())
        out = KVConnectorOutput(
            finished_recving=set(connector_output.finished_recving or ()), invalid_block_ids=invalid
        )
        self.point.notify("update_connector_output", ({self.name: out},), None)


def observed_worker(
    cls: Any, name: str, point: MonitorPoint, owners: Callable[[set[int], set[str]], set[str]] | None = None
) -> type:
    """A subclass of the worker ``cls`` whose ``wait_for_layer_load`` and ``get_finished`` ``point`` watches.

    What the monitors add to the step's report as invalid blocks (an injected
    failed load) is reported in ``get_block_ids_with_load_errors`` with the
    connector's own. With several KV-cache groups vLLM takes no invalid
    blocks (``Scheduler._handle_invalid_blocks`` raises): given ``owners``
    (``owners(blocks, finished_recving)``: the requests among those whose
    tables hold ``blocks``), a failed async load is reported per request, in
    ``get_transfer_results``' ``failed_recving``, as vLLM asks of such a
    connector; a sync one still goes in ``get_block_ids_with_load_errors``
    (vLLM has no other way for it).
    """

    class ObservedWorker(cls):
        _injected: frozenset[int] = frozenset()

        def wait_for_layer_load(self, layer_name: str) -> None:
            cls.wait_for_layer_load(self, layer_name)
            point.notify("wait_for_layer_load", (layer_name,), None)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            sending, recving = cls.get_finished(self, finished_req_ids)
            outputs = point.notify(
                "get_finished", (finished_req_ids,), {name: KVConnectorOutput(finished_recving=set(recving or ()))}
            )
            self._injected = frozenset(outputs[name].invalid_block_ids)
            return sending, recving

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            results = cls.get_transfer_results(self, finished_req_ids)  # through get_finished above
            if owners is not None and self._injected:
                failed = owners(set(self._injected), set(results.finished_recving))
                if failed:
                    results.failed_recving |= failed
                    self._injected = frozenset()
            return results

        def get_block_ids_with_load_errors(self) -> set[int]:
            injected, self._injected = self._injected, frozenset()
            return set(cls.get_block_ids_with_load_errors(self)) | injected

    ObservedWorker.__name__ = ObservedWorker.__qualname__ = f"Observed{cls.__name__}"
    return ObservedWorker


class NativeDataDriver(VllmDataRunDriver):
    """A vLLM connector's data runs (see the module docstring); keywords as :class:`~.data_driver.VllmDataDriver`'s.

    ``worker_config`` is refused: a vLLM connector has one config for both sides.
    """

    def __init__(
        self,
        spec: DriverSpec,
        target: NativeTarget,
        *,
        fail_loads: FailureMode | None = None,
        scrub_freed: bool = False,
        worker_config: Mapping[str, Any] | None = None,
    ) -> None:
        import vllm

        if worker_config is not None:
            raise NotImplementedError("a vLLM connector's worker takes the connector's one config")
        self._scheduler_point, self._worker_point = MonitorPoint(), MonitorPoint()
        self.calls = SchedulerCalls(target.name, self._scheduler_point)
        observer = NativeObserver(target, self.calls)
        several_groups = len(spec.shape.kv_cache_groups) > 1
        shape, scheduler, make_worker = native_engine(
            spec,
            observer,
            lambda cls: observed_worker(cls, target.name, self._worker_point, self._owners if several_groups else None),
        )
        loop = observer.loop = ModelLoop(scheduler, scrub_freed=scrub_freed, make_worker=make_worker)
        super().__init__(spec, shape, loop, observer)
        counted = ("update_state_after_alloc", "update_connector_output")
        self._scheduler_point.add_monitor(after=self._count, calls=counted)
        self.failures = watch_data_run(
            target.name,
            fail_loads,
            engine=f"vLLM {vllm.__version__} scheduler",
            block_size=self.block_size,
            hosts=(self._scheduler_point, self._worker_point),  # type: ignore[arg-type]
            kv_caches=loop.kv_caches,
            group_of_layer={layer: g for g, layers in enumerate(loop.group_layers) for layer in layers},
        )

    def _owners(self, blocks: set[int], req_ids: set[str]) -> set[str]:
        """The requests among ``req_ids`` whose tables hold any of ``blocks`` (where a failure was injected).

        Read from vLLM's scheduler, which still holds a request whose async load the worker reports done.
        """
        manager = self.scheduler.kv_cache_manager
        return {r for r in req_ids if any(blocks & set(table) for table in manager.get_block_ids(r))}

    def _count(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        """The stats the data checks read: prompt tokens the connector set out to load, blocks that failed."""
        if call == "update_state_after_alloc":
            request, _, plan = args
            if plan.num_tokens:
                self.committed(request, plan)
        else:
            self.stats.failed_load_blocks += len(args[0][self.calls.name].invalid_block_ids)
