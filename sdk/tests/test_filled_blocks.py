"""``filled_blocks`` and ``iter_block_ids``: which blocks a step fills, and their ids per KV-cache group.

The oracle is token-level: block ``i`` is filled on the step that computes its
last token, ``(i + 1) * block_size - 1``. It is checked on hand-built outputs
(every chunk start and length around block boundaries) and on the reference
engine (chunked prefill ending mid-block, a sliding-window group, preemption).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from kvconn import (
    NULL_BLOCK_ID,
    BlockIds,
    CachedRequestData,
    FilledBlocks,
    KVCacheGroupSpec,
    KVConnector,
    KVConnectorBlockState,
    KVConnectorMetadata,
    NewRequestData,
    SchedulerOutput,
    filled_blocks,
    iter_block_ids,
)
from kvconn.testing import create_requests, create_scheduler, run_to_completion


def output(new: dict[str, tuple[int, int]], cached: dict[str, tuple[int, int]] | None = None) -> SchedulerOutput:
    """A step scheduling ``new`` and ``cached`` requests: ``req_id -> (num_computed_tokens, num_scheduled)``."""
    cached = cached or {}
    scheduled = {r: n for r, (_, n) in (new | cached).items()}
    return SchedulerOutput(
        step=0,
        scheduled_new_reqs=[NewRequestData(r, [], ([],), computed) for r, (computed, _) in new.items()],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=list(cached),
            resumed_from_preemption=[False] * len(cached),
            new_token_ids=[[] for _ in cached],
            new_block_ids=[None for _ in cached],
            num_computed_tokens=[computed for computed, _ in cached.values()],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
    )


def blocks_whose_last_token_is_in(start: int, end: int, block_size: int) -> list[int]:
    """The oracle: blocks whose last token is one of tokens ``[start, end)``."""
    return [i for i in range(end // block_size + 1) if start <= (i + 1) * block_size - 1 < end]


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_a_step_fills_exactly_the_blocks_whose_last_token_it_computes(block_size: int) -> None:
    # Chunk starts and ends on, just before and just after block boundaries, and mid-block.
    points = sorted({max(0, k * block_size + d) for k in range(4) for d in (-1, 0, 1, block_size // 2)})
    for computed in points:
        for end in points:
            if end <= computed:
                continue
            (filled,) = filled_blocks(output({"r": (computed, end - computed)}), block_size)
            assert list(range(filled.start, filled.end)) == blocks_whose_last_token_is_in(computed, end, block_size)
            assert filled.start == computed // block_size  # the block holding the first scheduled token


def test_every_scheduled_request_is_yielded_new_and_cached_even_when_it_fills_nothing() -> None:
    step = output({"new": (0, 40)}, {"decode": (37, 1), "fills": (47, 1)})
    assert list(filled_blocks(step, 16)) == [
        FilledBlocks("new", 0, 2),  # a chunk ending mid-block: the third block is not full yet
        FilledBlocks("decode", 2, 2),  # fills nothing, still yielded (a cursor may have blocks to send)
        FilledBlocks("fills", 2, 3),  # a decode token that completes a block
    ]


def test_a_multiple_of_the_block_size_counts_whole_groups_of_blocks() -> None:
    """A connector storing 4 engine blocks as one passes ``4 * block_size``."""
    (filled,) = filled_blocks(output({"r": (60, 70)}), 4 * 16)
    assert (filled.start, filled.end) == (0, 2)  # tokens 0-63 and 64-127 are complete, 128-129 not


def test_a_request_resumed_after_preemption_fills_its_blocks_again() -> None:
    before = output({}, {"r": (64, 16)})
    resumed = output({}, {"r": (0, 80)})  # preempted: its blocks were freed and it recomputes from 0
    assert list(filled_blocks(before, 16)) == [FilledBlocks("r", 4, 5)]
    assert list(filled_blocks(resumed, 16)) == [FilledBlocks("r", 0, 5)]


@pytest.mark.parametrize("block_size", [0, -16])
def test_a_block_size_below_one_is_refused_with_the_value(block_size: int) -> None:
    with pytest.raises(ValueError, match=f"block_size must be a positive number of tokens, got {block_size}"):
        list(filled_blocks(output({"r": (0, 16)}), block_size))


def test_block_ids_skip_the_null_block_and_indices_past_a_table() -> None:
    # group 0: full attention; group 1: sliding window, blocks 0-1 outside it; group 2: a shorter table
    table: BlockIds = ([5, 6, 7, 8], [NULL_BLOCK_ID, NULL_BLOCK_ID, 17, 18], [25, 26])
    assert list(iter_block_ids(table, 1, 4)) == [
        (1, 0, 6),
        (1, 2, 26),
        (2, 0, 7),
        (2, 1, 17),
        (3, 0, 8),
        (3, 1, 18),
    ]
    assert list(iter_block_ids(table, 2, 2)) == []


class RecorderMetadata(KVConnectorMetadata):
    pass


class Recorder(KVConnector):
    """Records, per step and request: the filled range, the ids of its blocks, those of every full block, the table."""

    Metadata = RecorderMetadata
    steps: ClassVar[list[dict[str, tuple[FilledBlocks, list[tuple[int, int, int]], list[tuple[int, int, int]]]]]] = []

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> RecorderMetadata:
        step = {}
        for filled in filled_blocks(scheduler_output, self.context.block_size):
            table = block_state.get_block_ids(filled.req_id)
            assert table is not None  # every scheduled request is offered
            ids = list(iter_block_ids(table, filled.start, filled.end))
            step[filled.req_id] = (filled, ids, list(iter_block_ids(table, 0, filled.end)))
        self.steps.append(step)
        return RecorderMetadata()


def run_recorded(num_requests: int, num_tokens: int, **engine: Any) -> list[SchedulerOutput]:
    Recorder.steps = []
    scheduler = create_scheduler(f"{__name__}:Recorder", **engine)
    for request in create_requests(num_requests, num_tokens, block_size=engine["block_size"], max_tokens=40):
        scheduler.add_request(request)
    return run_to_completion(scheduler)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_on_the_reference_engine_each_block_is_reported_filled_once_and_windows_skip_freed_blocks(
    block_size: int,
) -> None:
    """Chunks of 37 tokens end mid-block; a sliding-window group's blocks outside the window are never listed.

    The blocks a step fills are all inside the window of its first token; the
    blocks before it (what a cursor that fell behind, or a load, would list)
    are the null block in the engine's table, and are skipped.
    """
    window = 24
    groups = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=window))
    outputs = run_recorded(3, 100, block_size=block_size, max_num_batched_tokens=37, kv_cache_groups=groups)
    assert len(outputs) == len(Recorder.steps)
    reported: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    for out, step in zip(outputs, Recorder.steps, strict=True):
        assert set(step) == set(out.num_scheduled_tokens)
    windowed = 0
    for out, step in zip(outputs, Recorder.steps, strict=True):
        assert set(step) == set(out.num_scheduled_tokens)
        for req_id, (filled, ids, every) in step.items():
            start = computed.get(req_id, 0)
            end = start + out.num_scheduled_tokens[req_id]
            computed[req_id] = end
            blocks = blocks_whose_last_token_is_in(start, end, block_size)
            assert list(range(filled.start, filled.end)) == blocks
            reported.setdefault(req_id, []).extend(blocks)
            assert [(i, g) for i, g, _ in ids] == [(i, g) for i in blocks for g in (0, 1)]
            first_in_window = groups[1].first_needed_block(start, block_size)
            assert [i for i, g, _ in every if g == 0] == list(range(filled.end))
            assert [i for i, g, _ in every if g == 1] == list(range(min(first_in_window, filled.end), filled.end))
            assert all(b != NULL_BLOCK_ID for _, _, b in every)
            windowed += first_in_window > 0
    for req_id, blocks in reported.items():
        assert blocks == list(range(computed[req_id] // block_size)), req_id  # each full block once, in order
    assert windowed  # the window did leave blocks out


def test_on_the_reference_engine_a_preempted_request_reports_its_blocks_again() -> None:
    # A pool too small for four requests, and chunks of 40 tokens (ending mid-block).
    outputs = run_recorded(4, 84, block_size=16, num_blocks=16, max_num_batched_tokens=40, enable_prefix_caching=False)
    cached = [out.scheduled_cached_reqs for out in outputs]
    resumed = [r for c in cached for r, flag in zip(c.req_ids, c.resumed_from_preemption, strict=True) if flag]
    assert resumed, "the pool was meant to force a preemption"
    ranges = [step[resumed[0]][0] for step in Recorder.steps if resumed[0] in step]
    restarts = [k for k in range(1, len(ranges)) if ranges[k].start < ranges[k - 1].end] + [len(ranges)]
    # Before the first preemption and after each, every block once, in order, from block 0.
    for begin, stop in zip([0, *restarts], restarts, strict=False):
        refilled = [i for r in ranges[begin:stop] for i in range(r.start, r.end)]
        assert ranges[begin].start == 0  # computed restarts at 0 (no prefix cache)
        assert refilled == list(range(len(refilled)))
    assert len(restarts) > 1
