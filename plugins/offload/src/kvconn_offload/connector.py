"""``OffloadConnector``: what the ``offload`` connector is; its sides implement the hooks."""

from __future__ import annotations

import kvconn
from kvconn.telemetry import MetricSpec

from .config import OffloadConfig
from .metadata import OffloadMetadata
from .scheduler import OffloadScheduler

__all__ = ["OffloadConnector"]


class OffloadConnector(kvconn.KVConnector):
    """Offloads full KV blocks to a host-memory pool and loads them back on prefix hits."""

    Config = OffloadConfig
    Metadata = OffloadMetadata
    saves = True
    loads = True
    api_version = "1.0"
    scheduler_side = OffloadScheduler
    worker_side = "kvconn_offload.worker:OffloadWorker"  # imports torch: only where a worker is built
    cache_tier = "host"
    metrics = (
        MetricSpec("pool_used_blocks", "gauge", "Offloaded blocks held in the host pool"),
        MetricSpec("pool_blocks", "gauge", "Offloaded blocks the host pool can hold"),
        MetricSpec("evictions", "counter", "Offloaded blocks evicted from the host pool to make room"),
    )
