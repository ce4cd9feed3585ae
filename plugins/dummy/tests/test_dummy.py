"""The dummy is the template to copy: it resolves only the requests it acts on and keeps bounded state."""

from __future__ import annotations

from dataclasses import dataclass

from kvconn import BlockIds, ConnectorContext, KVConnectorBlockState, KVConnectorRole, SchedulerOutput
from kvconn.outputs import CachedRequestData
from kvconn_dummy import MAX_RECORDED_CALLS, DummyConnector

BLOCK_SIZE = 4


@dataclass
class _Request:
    request_id: str
    num_computed_tokens: int


def _decode_step(step: int, computed: dict[str, int]) -> SchedulerOutput:
    """One decode token for each request, from ``computed`` tokens on."""
    ids = list(computed)
    return SchedulerOutput(
        step=step,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(req_ids=ids, num_computed_tokens=[computed[r] for r in ids]),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=len(ids),
    )


def test_resolves_and_ships_only_the_blocks_each_step_fills() -> None:
    dummy = DummyConnector(role=KVConnectorRole.SCHEDULER, context=ConnectorContext(block_size=BLOCK_SIZE))
    tables = {r: ([10 * i + b for b in range(1, 9)],) for i, r in enumerate(("a", "b", "c"), start=1)}
    computed = {"a": 9, "b": 10, "c": 11}  # each fills its next block on a different step
    for req_id, n in computed.items():
        dummy.update_state_after_alloc(_Request(req_id, n))
    resolved: list[str] = []

    def resolve(req_id: str) -> BlockIds:
        resolved.append(req_id)
        return tables[req_id]

    shipped = []
    for step in range(8):
        offered = set(computed) - ({"c"} if step == 0 else set())  # c is not offered when it fills block 2
        meta = dummy.build_connector_meta(_decode_step(step, computed), KVConnectorBlockState(offered, resolve))
        shipped.append(meta.block_ids_by_req)
        computed = {r: n + 1 for r, n in computed.items()}
    # 8 decode steps of 3 requests: each fills 2 blocks (not 24 resolves); c's first is shipped a step late
    assert sorted(resolved) == ["a", "a", "b", "b", "c", "c"]
    assert shipped == [{}, {"b": ([23],), "c": ([33],)}, {"a": ([13],)}, {}, {"c": ([34],)}, {"b": ([24],)},
                       {"a": ([14],)}, {}]  # fmt: skip
    assert dummy.get_num_tracked_requests() == 3


def test_the_call_log_is_bounded() -> None:
    dummy = DummyConnector(role=KVConnectorRole.WORKER)
    for i in range(MAX_RECORDED_CALLS + 10):
        dummy.save_kv_layer(f"layer.{i}")
    assert len(dummy.calls) == MAX_RECORDED_CALLS
    assert dummy.calls[-1] == ("save_kv_layer", f"layer.{MAX_RECORDED_CALLS + 9}")
