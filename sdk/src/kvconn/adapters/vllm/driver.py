"""The ``vllm`` conformance driver: scenarios played through vLLM's real scheduler.

``run_conformance(name, driver="vllm")`` (and ``kvconn validate NAME --engine
vllm``) builds, per scenario, vLLM's v1 ``Scheduler`` on the CPU with the
connector loaded through :class:`KVConnVllmConnector`, plus a worker-side
adapter on fake KV caches (:class:`~.harness.VllmLoop`). Observation happens
at the adapter's ``ConnectorHost``, exactly where the reference driver
observes, so every scheduler-side check reads the same :class:`StepRecord`.

Importing this module does not import vLLM; :func:`load_driver` does, and
raises a one-line error when vLLM is missing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

from ...block_state import BlockIds, KVConnectorBlockState
from ...errors import ConnectorLoadError
from ...metadata import KVConnectorMetadata
from ...outputs import KVConnectorOutput, SchedulerOutput
from ...testing.conformance.driver import (
    DriverFactory,
    DriverSpec,
    StepRecord,
    observed_block_state,
    tracked_by_role,
)
from ...wire import decode_metadata
from .reports import decode_report

__all__ = ["VllmDriver", "load_driver"]


def load_driver() -> DriverFactory:
    """The driver factory; :class:`ConnectorLoadError` when vLLM cannot be imported."""
    from .harness import prepare_environment, vllm_import_error

    prepare_environment()
    error = vllm_import_error()
    if error is not None:
        raise ConnectorLoadError(
            f"vLLM is not installed in this environment: {error} "
            "(install it with scripts/install-vllm-venv.sh scheduler and run kvconn from that venv)"
        )
    return VllmDriver


class VllmDriver:
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over vLLM's scheduler."""

    def __init__(self, spec: DriverSpec) -> None:
        from .harness import VllmLoop, make_scheduler

        self.block_size, self.num_blocks = spec.block_size, spec.num_blocks
        self.name = spec.connector
        self.scheduler = make_scheduler(
            spec.connector,
            spec.config,
            block_size=spec.block_size,
            num_blocks=spec.num_blocks,
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=2048,
            enable_prefix_caching=spec.enable_prefix_caching,
            kv_cache_groups=spec.kv_cache_groups,
        )
        self.loop = VllmLoop(self.scheduler)
        self.adapter = self.scheduler.connector
        self.metadata_type = self.adapter.host.metadata_types[self.name]
        self._finished_calls: Counter[str] = Counter()
        self._withhold: frozenset[str] = frozenset()
        self._built: tuple[SchedulerOutput, KVConnectorMetadata | None, frozenset[str], list[str]] | None = None
        self._observe()

    def _observe(self) -> None:
        """Wrap the scheduler-side host (instance attributes shadow its methods)."""
        host = self.adapter.host
        build, finished = host.build_connector_meta, host.request_finished

        def build_connector_meta(
            output: SchedulerOutput, block_state: KVConnectorBlockState
        ) -> dict[str, KVConnectorMetadata]:
            resolved: list[str] = []
            observed = observed_block_state(block_state, self._withhold, resolved)
            metadata = build(output, observed)
            self._built = (output, metadata.get(self.name), frozenset(observed.req_ids), resolved)
            return metadata

        def request_finished(request: Any, block_ids: BlockIds) -> bool:
            self._finished_calls[request.request_id] += 1
            return finished(request, block_ids)

        host.build_connector_meta = build_connector_meta
        host.request_finished = request_finished

    # ---------------------------------------------------------------- protocol

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        from .harness import make_request

        self.scheduler.add_request(make_request(req_id, prompt, max_tokens, self.block_size))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        self._withhold, self._built = frozenset(withhold), None
        preemptions = {r: req.num_preemptions for r, req in self.scheduler.requests.items()}
        tables: dict[str, BlockIds] = {}
        self.loop.step(inspect=lambda _: tables.update(self._tables()))
        assert self._built is not None, "vLLM did not call build_connector_meta"
        output, metadata, offered, resolved = self._built
        sent = self.loop.outputs[-1].kv_connector_metadata
        encoded = sent.connectors.get(self.name) if metadata is not None else None
        types = {self.name: self.metadata_type}
        decoded = decode_metadata(self.name, encoded, types) if encoded is not None else None
        kv_output = self.loop.last_kv_output  # None after a step without a forward whose workers reported nothing
        worker_meta = kv_output.kv_connector_worker_meta if kv_output is not None else None
        reports = [decode_report(blob).outputs.get(self.name) for blob in worker_meta.reports] if worker_meta else []
        requests = self.scheduler.requests
        return StepRecord(
            output=output,
            metadata=metadata,
            decoded=decoded,
            encoded=encoded,
            tables=tables,
            offered=offered,
            resolved=resolved,
            connector_output=reports[0] if reports else KVConnectorOutput(),  # no report: the worker had no news
            preempted={r for r, n in preemptions.items() if r in requests and requests[r].num_preemptions > n},
        )

    def _tables(self) -> dict[str, BlockIds]:
        manager = self.scheduler.kv_cache_manager
        tables = {r: manager.get_block_ids(r) for r in self.scheduler.requests}
        return {r: tuple(list(t) for t in table) for r, table in tables.items() if any(table)}

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def num_tracked_requests(self) -> dict[str, int]:
        return tracked_by_role(self.name, self.adapter.host, self.loop.worker.host)

    def assert_empty(self) -> None:
        scheduler = self.scheduler
        assert not scheduler.requests, f"requests still held by vLLM: {sorted(scheduler.requests)}"
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == self.num_blocks - 1, f"{self.num_blocks - 1 - free} blocks not returned to vLLM's pool"
        loads = {name: reqs for name, reqs in self.adapter.host.pending_loads().items() if reqs}
        assert not loads, f"loads still in flight: {loads}"

    def close(self) -> None:
        self.adapter.shutdown()
        self.loop.worker.shutdown()
