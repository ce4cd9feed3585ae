"""The dummy connector: the smallest complete kvconn plugin, and the one to copy.

It moves no KV, but it has the shape of a full-block saver, the pattern a
real connector follows: each step it finds the requests whose scheduled
tokens fill a block (from ``num_scheduled_tokens`` alone, no table read),
resolves only those tables, and ships only the blocks filled this step, as
plain lists. Its cost per step grows with the requests scheduled, not with
the blocks they hold, and its memory with the requests in flight (one int
each, dropped in ``request_finished``). It keeps the last
:data:`MAX_RECORDED_CALLS` hook calls in ``calls`` so tests can see what an
engine did; the log is bounded, so a long-running engine does not grow it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

import kvconn
from kvconn import BlockIds, ConnectorRequest, KVConnectorBlockState, KVConnectorMetadata, SchedulerOutput

__all__ = ["MAX_RECORDED_CALLS", "DummyConfig", "DummyConnector", "DummyMetadata"]

#: How many of the most recent hook calls ``DummyConnector.calls`` keeps.
MAX_RECORDED_CALLS = 1000


class DummyConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Options of the dummy connector."""

    record_calls: Annotated[
        bool,
        msgspec.Meta(description=f"Keep the last {MAX_RECORDED_CALLS} hook calls in DummyConnector.calls (tests)."),
    ] = True


class DummyMetadata(KVConnectorMetadata):
    """Plain data only: per request, the blocks this step filled (one list per KV-cache group)."""

    block_ids_by_req: dict[str, BlockIds] = msgspec.field(default_factory=dict)


class DummyConnector(kvconn.KVConnector):
    """Finds the blocks each step fills, as a full-block saver must; moves no KV."""

    Config = DummyConfig
    Metadata = DummyMetadata
    api_version = "1.0"
    config: DummyConfig

    def __init__(self, config: DummyConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.calls: deque[tuple[str, Any]] = deque(maxlen=MAX_RECORDED_CALLS)
        # request id -> how many of its blocks were already shipped (full and reported)
        self._requests: dict[str, int] = {}

    def _record(self, hook: str, detail: Any = None) -> None:
        if self.config.record_calls:
            self.calls.append((hook, detail))

    def _record_ids(self, hook: str, ids: Iterable[str]) -> None:
        """Record request ids, sorted only when calls are recorded (no per-step sort otherwise)."""
        if self.config.record_calls:
            self.calls.append((hook, sorted(ids)))

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self._record("get_num_new_matched_tokens", request.request_id)
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest) -> None:
        self._record("update_state_after_alloc", request.request_id)
        # Blocks already computed (a local prefix hit) were not filled by this request's steps.
        # setdefault: a preempted request resumes where it was, its blocks are not shipped twice.
        self._requests.setdefault(request.request_id, request.num_computed_tokens // self.context.block_size)

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> DummyMetadata:
        filled: dict[str, BlockIds] = {}
        for req_id, _, full in kvconn.filled_blocks(scheduler_output, self.context.block_size):
            shipped = self._requests.get(req_id)
            if shipped is None or full <= shipped:
                continue  # fills no block this step: nothing to resolve
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue  # not offered this step: its blocks are shipped on a step it is
            blocks: BlockIds = tuple([] for _ in table)
            for _, group, block_id in kvconn.iter_block_ids(table, shipped, full):
                blocks[group].append(block_id)
            filled[req_id] = blocks
            self._requests[req_id] = full
        self._record_ids("build_connector_meta", filled)
        return DummyMetadata(block_ids_by_req=filled)

    def request_finished(self, request: ConnectorRequest) -> bool:
        self._record("request_finished", request.request_id)
        self._requests.pop(request.request_id, None)
        return False

    def get_num_tracked_requests(self) -> int:
        return len(self._requests)

    # worker side
    def start_load_kv(self, metadata: DummyMetadata) -> None:
        self._record_ids("start_load_kv", metadata.block_ids_by_req)

    def save_kv_layer(self, layer_name: str) -> None:
        self._record("save_kv_layer", layer_name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        self._record_ids("get_finished", finished_req_ids)
        return None, None
