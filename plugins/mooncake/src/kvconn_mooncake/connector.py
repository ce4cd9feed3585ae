"""``MooncakeConnector``: the hooks, delegated to the side this instance serves."""

from __future__ import annotations

from typing import Any

from kvconn import (
    BlockIds,
    ConnectorRequest,
    KVConnector,
    KVConnectorBlockState,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
)

from .backends import StoreLease, acquire_store
from .config import MooncakeConfig
from .integrity import Integrity, secret_id
from .keys import BlockKeys
from .metadata import MooncakeMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

__all__ = ["MooncakeConnector"]


class MooncakeConnector(KVConnector):
    """Saves full KV blocks to a Mooncake store and loads prefix hits from it.

    Backends: the real ``MooncakeDistributedStore`` when a master is
    configured, else an embedded in-process store with the same semantics
    (see :class:`~kvconn_mooncake.config.MooncakeConfig`). Store errors and
    calls past their deadline degrade to "not saved" / "recompute", and a
    loaded value reaches the KV cache only once verified; nothing raises into
    the engine.
    """

    Config = MooncakeConfig
    Metadata = MooncakeMetadata
    saves = True
    loads = True
    api_version = "1.0"
    config: MooncakeConfig

    def __init__(self, config: MooncakeConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._lease: StoreLease | None = acquire_store(self.config)
        self.backend = self._lease.backend
        store = self._lease.store
        secret = self.config.integrity_secret
        keys = BlockKeys(self.context, secret_id(secret))
        self._scheduler = (
            SchedulerSide(store, keys, self.context, self.config.save_decode_cache)
            if self.role is KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = (
            WorkerSide(store, self.context, Integrity(secret), keys) if self.role is KVConnectorRole.WORKER else None
        )

    @property
    def in_process_state(self) -> bool:  # type: ignore[override]
        """The embedded store lives in this process: its scheduler and workers must share it."""
        return self.backend == "embedded"

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"{self!r} serves the worker role: scheduler hooks are not available")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"{self!r} serves the scheduler role: worker hooks are not available")
        return self._worker

    # ------------------------------------------------------------ scheduler

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> MooncakeMetadata:
        return self.scheduler_side.build_meta(scheduler_output, block_state)

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> bool:
        return self.scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    # --------------------------------------------------------------- worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, metadata: MooncakeMetadata) -> None:
        self.worker_side.start_load_kv(metadata)

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save()

    def get_finished(self) -> tuple[set[str], None]:
        return self.worker_side.get_finished(), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self.worker_side.take_stats()

    # ----------------------------------------------------------------- both

    def get_num_tracked_requests(self) -> int:
        return self._scheduler.num_tracked_requests() if self._scheduler is not None else 0

    def shutdown(self) -> None:
        """Release the store (the last connector using a real client closes it, once)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
