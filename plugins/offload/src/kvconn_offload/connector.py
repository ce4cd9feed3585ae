"""``OffloadConnector``: the hooks, dispatched to the side this instance serves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kvconn
from kvconn import (
    BlockIds,
    ConnectorContext,
    ConnectorRequest,
    KVConnectorBlockState,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
)

from .config import OffloadConfig
from .metadata import OffloadMetadata
from .scheduler import OffloadScheduler

if TYPE_CHECKING:  # the worker side imports torch: only when a worker is built
    from .worker import OffloadWorker

__all__ = ["OffloadConnector"]


class OffloadConnector(kvconn.KVConnector):
    """Offloads full KV blocks to a host-memory pool and loads them back on prefix hits."""

    Config = OffloadConfig
    Metadata = OffloadMetadata
    saves = True
    loads = True
    api_version = "1.0"
    config: OffloadConfig

    def __init__(
        self, config: OffloadConfig | None = None, *, role: KVConnectorRole, context: ConnectorContext | None = None
    ) -> None:
        super().__init__(config, role=role, context=context)
        self.scheduler: OffloadScheduler | None = None
        self.worker: OffloadWorker | None = None
        if self.role is KVConnectorRole.SCHEDULER:
            self.scheduler = OffloadScheduler(self.config, self.context)
        else:
            from .worker import OffloadWorker

            self.worker = OffloadWorker(self.config, self.context)

    @property
    def _sched(self) -> OffloadScheduler:
        assert self.scheduler is not None, "scheduler-side hook called on a worker-side instance"
        return self.scheduler

    @property
    def _work(self) -> OffloadWorker:
        assert self.worker is not None, "worker-side hook called on a scheduler-side instance"
        return self.worker

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self._sched.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> OffloadMetadata:
        return self._sched.build_connector_meta(scheduler_output, block_state)

    def request_finished(self, request: ConnectorRequest) -> bool:
        return self._sched.request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched.update_connector_output(connector_output)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: OffloadMetadata) -> None:
        self._work.start_load_kv(metadata)

    def save_kv_layer(self, layer_name: str) -> None:
        self._work.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work.wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self._work.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self._work.get_kv_connector_stats()

    # both
    def get_num_tracked_requests(self) -> int:
        if self.scheduler is not None:
            return self.scheduler.get_num_tracked_requests()
        return self._work.get_num_tracked_requests()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
