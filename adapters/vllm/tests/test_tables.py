"""``TableTracker`` with vLLM 0.29's dict block state: its tables win, the tracker fills its gaps."""

from __future__ import annotations

from kvconn.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvconn_vllm.tables import TableTracker


def _step(new: dict[str, list[int]], cached: dict[str, list[int] | None], scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput(
        step=0,
        scheduled_new_reqs=[NewRequestData(r, [1, 2], ([*b],), 0) for r, b in new.items()],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(cached),
            resumed_from_preemption=[False] * len(cached),
            new_token_ids=[[] for _ in cached],
            new_block_ids=[None if b is None else ([*b],) for b in cached.values()],
            num_computed_tokens=[0] * len(cached),
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def test_the_dict_offers_its_requests_and_the_tracker_the_block_fill_steps() -> None:
    tracker = TableTracker()
    tracker.update(_step({"a": [3, 4], "b": [5]}, {}, {"a": 32, "b": 8}))
    # a fills its second block and gets none: vLLM 0.29's dict leaves it out; b got block 6
    output = _step({}, {"a": None, "b": [6]}, {"a": 1, "b": 8})
    tracker.update(output)
    state = tracker.block_state(output, {"b": ([5, 6],)})
    assert state.req_ids == {"a", "b"}
    assert state.get_block_ids("a") == ([3, 4],) and state.get_block_ids("b") == ([5, 6],)
    assert TableTracker.snapshot_state({"b": ([5, 6],)}).get_block_ids("a") is None  # sliding windows: vLLM's only
