"""``MooncakeConnector``: what the ``mooncake`` connector is; its sides implement the hooks."""

from __future__ import annotations

from kvconn import KVConnector

from .config import MooncakeConfig
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
    scheduler_side = SchedulerSide
    worker_side = WorkerSide
    side: SchedulerSide | WorkerSide

    @property
    def in_process_state(self) -> bool:  # type: ignore[override]
        """The embedded store lives in this process: its scheduler and workers must share it."""
        return self.side.backend == "embedded"
