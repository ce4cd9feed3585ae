"""Per-connector worker reports, carried from vLLM's workers to its scheduler.

vLLM's ``KVConnectorOutput`` has one ``finished_sending`` / ``finished_recving``
set for the whole connector; kvconn's host needs each connector's own report
(a request delayed by two connectors is freed only when both are done; a
connector that raised on a worker has its loads recomputed). So each worker
encodes a :class:`WorkerReport` (msgpack) into vLLM's
``kv_connector_worker_meta``, which vLLM concatenates over the workers of a
step; the scheduler side merges them with a :class:`ReportCollector`.

Merging follows vLLM's own ``KVOutputAggregator``: a transfer counts as
finished once ``world_size`` workers reported it (each rank holds its own
shard of every block); invalid blocks and failures of any worker count.
Counters are summed over the workers; a private (``_``) stats key is a gauge,
and the scheduler side gets the smallest value the workers reported: the
state every worker has reached (a store sequence number, a pool size).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kvconn.outputs import KVConnectorOutput

__all__ = ["ReportCollector", "WorkerReport", "decode_report", "encode_report"]


class WorkerReport(msgspec.Struct):
    """One worker's report for one step.

    ``outputs``: each connector's output (from ``ConnectorHost.get_finished``).
    ``failed_recving``: async loads the scheduler already knew had failed
    (their blocks are reported invalid in the same step); the scheduler
    releases them as finished.
    """

    outputs: dict[str, KVConnectorOutput]
    failed_recving: set[str] = msgspec.field(default_factory=set)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(WorkerReport)


def encode_report(report: WorkerReport) -> bytes:
    return _encoder.encode(report)


def decode_report(data: bytes) -> WorkerReport:
    return _decoder.decode(data)


class ReportCollector:
    """Merges the workers' reports of each step into one output per connector."""

    def __init__(self, names: Sequence[str], world_size: int) -> None:
        self.names = list(names)
        self.world_size = max(1, world_size)
        self._remaining: dict[tuple[str, str, str], int] = {}

    def _count(self, key: tuple[str, str, str]) -> bool:
        left = self._remaining.get(key, self.world_size) - 1
        if left:
            self._remaining[key] = left
            return False
        self._remaining.pop(key, None)
        return True

    def collect(self, blobs: Iterable[bytes]) -> tuple[dict[str, KVConnectorOutput], set[str]]:
        """Per-connector outputs and the scheduler-known failed async loads."""
        merged = {name: KVConnectorOutput() for name in self.names}
        failed_recving: set[str] = set()
        for blob in blobs:
            report = decode_report(blob)
            failed_recving |= report.failed_recving
            for name, out in report.outputs.items():
                into = merged.setdefault(name, KVConnectorOutput())
                into.finished_sending |= {r for r in out.finished_sending if self._count((name, "send", r))}
                into.finished_recving |= {r for r in out.finished_recving if self._count((name, "recv", r))}
                into.invalid_block_ids |= out.invalid_block_ids
                into.failed = into.failed or out.failed
                for key, value in out.stats.items():  # a zero counter is kept, as the engine keeps it
                    if key not in into.stats:
                        into.stats[key] = value
                    elif key.startswith("_"):
                        into.stats[key] = min(into.stats[key], value)
                    else:
                        into.stats[key] += value
        return merged, failed_recving

    def pending(self) -> int:
        """Transfers reported by some workers but not yet by all."""
        return len(self._remaining)
