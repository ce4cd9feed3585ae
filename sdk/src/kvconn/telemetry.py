"""What a connector tells operators: the tier it serves hits from, its metrics, the blocks it stores and drops.

Engine-neutral declarations, read by engine adapters, which turn them into the
engine's own telemetry (the vLLM adapter: Prometheus series per connector, the
by-source counters of cached prompt tokens, KV-cache events for routers). A
connector never touches an engine's metrics library: it declares, and reports
numbers in its stats.

* :attr:`KVConnector.cache_tier <kvconn.KVConnector.cache_tier>`: where its hits come from
  (:data:`CacheTier`).
* Stats keys (a worker side's ``get_kv_connector_stats``, a scheduler side's
  ``scheduler_stats()``): the :data:`STANDARD_COUNTERS` by name, degraded events
  as ``"degraded.<reason>"``, and the metrics the connector declares in
  :attr:`KVConnector.metrics <kvconn.KVConnector.metrics>` (:class:`MetricSpec`).
* Events: a scheduler side's ``take_events()`` returns the :class:`BlockStored` /
  :class:`BlockRemoved` events since its last call. Engines that publish no
  events never call it, so a side records events only once it was first called.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, Union

import msgspec

__all__ = [
    "DEGRADED_PREFIX",
    "STANDARD_COUNTERS",
    "BlockRemoved",
    "BlockStored",
    "CacheTier",
    "KVEvent",
    "MetricSpec",
    "TIER_MEDIUM",
]

#: Where a connector's hits come from: host memory, a local disk, a remote store (Mooncake, Redis), another node.
CacheTier = Literal["host", "disk", "remote", "p2p"]

#: The storage medium of a tier, as KV-cache events name it.
TIER_MEDIUM: Mapping[str, str] = MappingProxyType(
    {"host": "CPU", "disk": "STORAGE", "remote": "STORAGE", "p2p": "STORAGE"}
)

#: Counters with a name and meaning shared by every connector: what engines sum over workers and steps.
#: A connector reports the ones it counts (its worker side moves the blocks; the adapter counts lookups).
STANDARD_COUNTERS: Mapping[str, str] = MappingProxyType(
    {
        "blocks_saved": "KV blocks saved by the connector",
        "bytes_saved": "Bytes of KV blocks saved by the connector",
        "blocks_loaded": "KV blocks loaded by the connector",
        "bytes_loaded": "Bytes of KV blocks loaded by the connector",
        "lookups": "Prefix lookups of new requests the connector was asked",
        "hit_blocks": "Blocks the connector loaded on prefix hits, counted when the load is planned",
        "missed_blocks": "Full prompt blocks past the engine's own hit that the connector did not load",
        "failed_loads": "Loads of requests that failed (the request is recomputed)",
    }
)

#: A stats key ``"degraded.<reason>"`` counts degraded events (no save, or a recompute) for that reason.
DEGRADED_PREFIX = "degraded."


class MetricSpec(msgspec.Struct, frozen=True):
    """A metric a connector adds to the standard ones: its stats key ``name`` is exported under that name.

    ``kind``: a ``"counter"`` is summed (report what happened since the last
    report); a ``"gauge"`` is a level (report its current value; the latest wins).
    """

    name: str
    kind: Literal["counter", "gauge"]
    documentation: str


class BlockStored(msgspec.Struct, frozen=True):
    """Blocks now loadable from the connector, by the engine's block hashes (one per ``block_size`` tokens)."""

    block_hashes: list[bytes]
    block_size: int


class BlockRemoved(msgspec.Struct, frozen=True):
    """Blocks the connector no longer holds (evicted, or found stale)."""

    block_hashes: list[bytes]


KVEvent = Union[BlockStored, BlockRemoved]  # noqa: UP007  # a runtime alias on Python 3.10
