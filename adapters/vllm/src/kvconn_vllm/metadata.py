"""What crosses vLLM's processes for the adapter: plain data only, in vLLM's base types.

* scheduler -> workers: :class:`KVConnVllmMetadata` (pickled by vLLM's ``MessageQueue``) each step with work, and
  on an idle step an :data:`IdleStep` instead;
* workers -> scheduler: :class:`KVConnVllmWorkerMetadata` (vLLM's ``kv_connector_worker_meta``);
* both roles -> vLLM's stat loggers: :class:`KVConnVllmStats`.

Read by :mod:`.scheduler` (builds the metadata, reads the reports), :mod:`.worker` (the reverse) and vLLM. The
names are public (re-exported by :mod:`kvconn_vllm` and :mod:`.connector`); a change to a field changes what every
process of a deployment must agree on, and ``benchmarks/vllm_metadata_pickle.py`` measures the pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconn.host import LoadSpec

from .telemetry import aggregate_stats, reduce_stats

__all__ = [
    "NO_BLOCKS",
    "NO_IDS",
    "UNBOUND",
    "IdleStep",
    "KVConnVllmMetadata",
    "KVConnVllmStats",
    "KVConnVllmWorkerMetadata",
]


@dataclass
class KVConnVllmMetadata(KVConnectorMetadata):
    """What the scheduler sends the workers each step (plain data only).

    ``connectors``: each connector's metadata, msgpack-encoded.
    ``loads``: per connector, ``req_id -> (blocks, is_async)`` of its loads in flight.
    ``failed_loads``: loads vLLM planned that no connector will do (the loader
    failed while committing them): reported invalid by the workers.
    ``dropped``: connectors whose metadata failed this step: their loads fail.
    ``report``: the workers report this step even with nothing to say (a
    transfer is in flight, whose stall bound counts the reports).
    """

    connectors: dict[str, bytes] = field(default_factory=dict)
    loads: dict[str, dict[str, LoadSpec]] = field(default_factory=dict)
    failed_loads: dict[str, LoadSpec] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    report: bool = False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its fields, in order (vLLM pickles it every step: faster than a dataclass's state dict)."""
        return (KVConnVllmMetadata, (self.connectors, self.loads, self.failed_loads, self.dropped, self.report))


#: What the scheduler sends on an idle step: the connectors whose metadata is their ``Metadata()`` default.
#: A builtin tuple of names, not a class instance: vLLM pickles the metadata every step, and a class costs a
#: lookup of its module each way (~2 us a step, the largest share of an idle step's cost). vLLM only hands
#: the metadata from its scheduler to its workers' ``bind_connector_metadata``; it never reads its type.
IdleStep = tuple[str, ...]

#: A worker's metadata between steps, and on an idle step (read, never changed).
UNBOUND = KVConnVllmMetadata()
#: No request ids, no block ids (shared, never changed: what a step without failed loads has).
NO_IDS: frozenset[str] = frozenset()
NO_BLOCKS: frozenset[int] = frozenset()


@dataclass
class KVConnVllmWorkerMetadata(KVConnectorWorkerMetadata):
    """The workers' per-connector reports of one step (see :mod:`.reports`)."""

    reports: list[bytes] = field(default_factory=list)

    def aggregate(self, other: KVConnVllmWorkerMetadata) -> KVConnVllmWorkerMetadata:
        return KVConnVllmWorkerMetadata(self.reports + other.reports)


@dataclass
class KVConnVllmStats(KVConnectorStats):
    """Counters as ``{"<connector>.<counter>": value}``, summed over workers and steps; gauges and step seconds.

    The layout is :mod:`.telemetry`'s (gauges under ``"gauges"``, the seconds of
    each step's loads and saves under ``"seconds"``).
    """

    def aggregate(self, other: KVConnectorStats) -> KVConnVllmStats:
        return KVConnVllmStats(data=aggregate_stats(dict(self.data), other.data))

    def reduce(self) -> dict[str, int | float]:
        return reduce_stats(self.data)

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        return not self.data
