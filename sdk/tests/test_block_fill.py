"""The bug kvconn exists for: a block-fill step allocates no block, yet the saving request is offered."""

from __future__ import annotations

import msgspec
import pytest

from kvconn import KVConnector, KVConnectorBlockState, KVConnectorMetadata, SchedulerOutput
from kvconn.host.wire import decode_scheduler_output, encode_scheduler_output
from kvconn.testing import create_requests, create_scheduler, make_model_runner_output, run_to_completion


def test_block_fill_step_offers_the_live_table() -> None:
    block_size = 16
    scheduler = create_scheduler("dummy", block_size=block_size)
    (request,) = create_requests(1, num_tokens=3 * block_size - 1, block_size=block_size)
    scheduler.add_request(request)

    output = scheduler.schedule()
    scheduler.update_from_output(output, make_model_runner_output(output, scheduler=scheduler))

    # The first decode token fills the third block: nothing is allocated this step.
    output = scheduler.schedule()
    assert output.scheduled_cached_reqs.req_ids == [request.request_id]
    assert output.scheduled_cached_reqs.new_block_ids == [None]

    assert output.kv_connector_metadata is not None
    block_ids = output.kv_connector_metadata["dummy"].block_ids_by_req.get(request.request_id)  # type: ignore[attr-defined]
    live = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert len(live[0]) == 3
    assert block_ids == ([live[0][2]],)  # the block this step fills, read from the live table


class LegacyMetadata(KVConnectorMetadata):
    tables: dict[str, list[list[int]]] = msgspec.field(default_factory=dict)


class LegacyConnector(KVConnector):
    """Written against the old API: build_connector_meta(scheduler_output) and the eager dict."""

    Metadata = LegacyMetadata

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LegacyMetadata:
        state = scheduler_output.kv_connector_block_state
        assert state is not None
        with pytest.warns(DeprecationWarning):
            tables = state.block_ids
        return LegacyMetadata(tables={r: [list(g) for g in tables[r]] for r in scheduler_output.num_scheduled_tokens})


def test_legacy_connector_reading_scheduler_output_still_works() -> None:
    scheduler = create_scheduler(f"{__name__}:LegacyConnector", block_size=16)
    (request,) = create_requests(1, num_tokens=47, block_size=16)
    scheduler.add_request(request)
    for _ in range(2):
        output = scheduler.schedule()
        assert output.kv_connector_block_state is None  # it never leaves the scheduler
        assert output.kv_connector_metadata is not None
        meta = output.kv_connector_metadata[f"{__name__}:LegacyConnector"]
        assert isinstance(meta, LegacyMetadata)
        assert meta.tables[request.request_id] == [list(g) for g in scheduler.kv_cache_manager.get_block_ids("r0")]
        scheduler.update_from_output(output, make_model_runner_output(output, scheduler=scheduler))


def test_every_steps_output_round_trips_the_wire_without_the_block_state() -> None:
    scheduler = create_scheduler("dummy", block_size=16, max_num_batched_tokens=32)
    for request in create_requests(3, num_tokens=40, block_size=16, max_tokens=20):
        scheduler.add_request(request)
    from kvconn_dummy import DummyMetadata

    steps = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        decoded = decode_scheduler_output(encode_scheduler_output(output), {"dummy": DummyMetadata})
        assert decoded == output
        assert decoded.kv_connector_block_state is None
        scheduler.update_from_output(output, make_model_runner_output(output, scheduler=scheduler))
        steps += 1
    assert steps > 20


def test_block_state_offers_every_scheduled_request() -> None:
    seen: list[tuple[set[str], set[str]]] = []

    class Spy(KVConnector):
        def on_block_state(self, block_state: KVConnectorBlockState, scheduler_output: SchedulerOutput) -> None:
            seen.append((set(block_state.req_ids), set(scheduler_output.num_scheduled_tokens)))

    scheduler = create_scheduler(None, block_size=16)
    from kvconn import ConnectorHost, KVConnectorRole

    scheduler.host = ConnectorHost({"spy": Spy(role=KVConnectorRole.SCHEDULER)}, role="scheduler")
    for request in create_requests(4, num_tokens=30, block_size=16, max_tokens=8):
        scheduler.add_request(request)
    run_to_completion(scheduler)
    assert seen and all(offered == scheduled for offered, scheduled in seen)
