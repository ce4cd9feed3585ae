"""The dummy connector: the smallest complete kvconn plugin, and the one to copy.

It saves and loads nothing. Each step it resolves the tables of the requests
it acts on (all scheduled ones) into plain lists in its metadata, as a real
connector must, and it records every hook call so tests can see what an
engine did.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

import kvconn
from kvconn import BlockIds, ConnectorRequest, KVConnectorBlockState, KVConnectorMetadata, SchedulerOutput

__all__ = ["DummyConfig", "DummyConnector", "DummyMetadata"]


class DummyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Options of the dummy connector."""

    record_calls: Annotated[
        bool, msgspec.Meta(description="Keep a log of every hook call in DummyConnector.calls.")
    ] = True


class DummyMetadata(KVConnectorMetadata):
    """Plain data only: the resolved table of each scheduled request."""

    block_ids_by_req: dict[str, BlockIds] = msgspec.field(default_factory=dict)


class DummyConnector(kvconn.KVConnector):
    """Resolves and records; moves no KV."""

    Config = DummyConfig
    Metadata = DummyMetadata
    api_version = "1.0"
    config: DummyConfig

    def __init__(self, config: DummyConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.calls: list[tuple[str, Any]] = []
        self._requests: set[str] = set()

    def _record(self, hook: str, detail: Any = None) -> None:
        if self.config.record_calls:
            self.calls.append((hook, detail))

    def _record_sorted(self, hook: str, names: Iterable[str]) -> None:
        """Record ``names`` sorted (a stable log); the sort runs only when calls are recorded."""
        if self.config.record_calls:
            self.calls.append((hook, sorted(names)))

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self._record("get_num_new_matched_tokens", request.request_id)
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        self._record("update_state_after_alloc", request.request_id)
        self._requests.add(request.request_id)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> DummyMetadata:
        tables = {req_id: block_state.get_block_ids(req_id) for req_id in scheduler_output.num_scheduled_tokens}
        self._record_sorted("build_connector_meta", tables)
        return DummyMetadata(block_ids_by_req={r: t for r, t in tables.items() if t is not None})

    def request_finished(self, request: ConnectorRequest) -> bool:
        self._record("request_finished", request.request_id)
        self._requests.discard(request.request_id)
        return False

    def get_num_tracked_requests(self) -> int:
        return len(self._requests)

    # worker side
    def start_load_kv(self, metadata: DummyMetadata) -> None:
        self._record_sorted("start_load_kv", metadata.block_ids_by_req)

    def save_kv_layer(self, layer_name: str) -> None:
        self._record("save_kv_layer", layer_name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        self._record_sorted("get_finished", finished_req_ids)
        return None, None
