"""A kvconn plugin seen through the adapter: observed at its ``ConnectorHost``, where the reference driver looks.

:class:`HostObserver` is the :class:`~.scheduler_driver.StepObserver` of the ``vllm`` drivers for kvconn plugins
(:mod:`.driver`, :mod:`.data_driver`): a monitor on the scheduler-side host of the
:class:`~kvconn_vllm.connector.KVConnVllmConnector` vLLM built records what ``build_connector_meta`` saw and each
``request_finished``, so every scheduler-side check reads the same
:class:`~kvconn.testing.conformance.driver.StepRecord` as on the reference engine; what crossed to the worker is
read back from the step's sent metadata and the worker's report.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvconn.block_state import BlockIds
from kvconn.host import CallOutcome
from kvconn.host.wire import decode_metadata
from kvconn.outputs import KVConnectorOutput
from kvconn.testing.conformance.driver import StepRecord, observe_block_state, tracked_by_role

from ..reports import decode_report
from .harness import VllmLoop
from .scheduler_driver import Built

__all__ = ["HostObserver"]


class HostObserver:
    """Connector ``name`` in ``adapter`` (the scheduler's :class:`~kvconn_vllm.connector.KVConnVllmConnector`)."""

    def __init__(self, name: str, adapter: Any) -> None:
        self.name, self.adapter = name, adapter
        self.metadata_type = adapter.host.metadata_types[name]
        self.built: Built | None = None
        self._finished_calls: Counter[str] = Counter()
        self._withhold: frozenset[str] = frozenset()
        self._resolved: list[str] = []
        adapter.host.add_monitor(self._before, self._after, calls=("build_connector_meta", "request_finished"))

    def begin_step(self, withhold: frozenset[str]) -> None:
        self._withhold = withhold

    def _before(self, call: str, args: tuple[Any, ...]) -> None:
        if call == "build_connector_meta":
            self._resolved = []
            observe_block_state(args[1], self._withhold, self._resolved)
        else:
            self._finished_calls[args[0].request_id] += 1

    def _after(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if call == "build_connector_meta" and outcome.exception is None:
            output, block_state = args
            self.built = (output, outcome.result.get(self.name), frozenset(block_state.req_ids), self._resolved)

    def record(self, loop: VllmLoop, built: Built, preempted: set[str], tables: dict[str, BlockIds]) -> StepRecord:
        output, metadata, offered, resolved = built
        sent = loop.outputs[-1].kv_connector_metadata
        encoded = self.adapter.sent_metadata(sent, self.name) if metadata is not None else None
        types = {self.name: self.metadata_type}
        decoded = decode_metadata(self.name, encoded, types) if encoded is not None else None
        kv_output = loop.last_kv_output  # None after a step without a forward whose workers reported nothing
        worker_meta = kv_output.kv_connector_worker_meta if kv_output is not None else None
        reports = [decode_report(blob).outputs.get(self.name) for blob in worker_meta.reports] if worker_meta else []
        return StepRecord(
            output=output,
            metadata=metadata,
            decoded=decoded,
            encoded=encoded,
            tables=tables,
            offered=offered,
            resolved=resolved,
            connector_output=reports[0] if reports else KVConnectorOutput(),  # no report: the worker had no news
            preempted=preempted,
        )

    def finished_calls(self) -> dict[str, int]:
        return dict(self._finished_calls)

    def num_tracked_requests(self, loop: VllmLoop) -> dict[str, int]:
        return tracked_by_role(self.name, self.adapter.host, loop.worker.host)

    def assert_empty(self) -> None:
        loads = {name: reqs for name, reqs in self.adapter.host.pending_loads().items() if reqs}
        assert not loads, f"loads still in flight: {loads}"

    def close(self, loop: VllmLoop) -> None:
        self.adapter.shutdown()
        loop.shutdown()
