"""Which blocks a step fills: the computation every saving connector needs.

A connector that saves *full* blocks saves a block on the step that computes
its last token, which is often a step that allocates nothing. From the
scheduler output alone (no table read), :func:`filled_blocks` gives, for every
scheduled request, the block indices this step completes; :func:`iter_block_ids`
then turns an index range into the block ids of each KV-cache group, as the
table resolved from the block state holds them. Sliding-window blocks outside
the window are the null block in that table (the engine's contract, see
:class:`~kvconn.context.KVCacheGroupSpec`), so skipping the null block is what
keeps them out of saves and loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from .block_state import BlockIds
from .context import NULL_BLOCK_ID
from .outputs import SchedulerOutput

__all__ = ["FilledBlocks", "filled_blocks", "iter_block_ids"]


class FilledBlocks(NamedTuple):
    """The blocks one request's scheduled tokens fill this step.

    Blocks ``[start, end)`` become full on this step: ``start`` is the block
    holding the request's first scheduled token, ``end`` the number of full
    blocks once the step's tokens are computed. The range is empty on a step
    that fills no block (``start == end``).
    """

    req_id: str
    start: int
    end: int


def filled_blocks(scheduler_output: SchedulerOutput, block_size: int) -> Iterator[FilledBlocks]:
    """For every request scheduled this step, the blocks its scheduled tokens fill.

    The step computes tokens ``[n, n + num_scheduled_tokens[req_id])`` where
    ``n`` is the request's ``num_computed_tokens`` at the start of the step,
    so a chunk that ends mid-block fills only the blocks before that one, and
    a request resumed after preemption (whose ``n`` restarts) fills its blocks
    again. Every scheduled request is yielded, an empty range included, so a
    connector that keeps a per-request cursor can still send blocks it had
    to put off. ``block_size`` may be any multiple of the engine's (a
    connector that stores several engine blocks as one passes the product).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    computed = scheduler_output.num_computed_tokens_by_request()
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        start = computed[req_id]
        yield FilledBlocks(req_id, start // block_size, (start + num_tokens) // block_size)


def iter_block_ids(block_ids: BlockIds, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(block index, group, block id)`` for blocks ``[start, end)`` of every KV-cache group.

    Blocks in index order, groups in order within a block. The null block
    (sliding-window blocks outside the window) is skipped: it holds no data
    and must never be saved or loaded. So are indices past the end of a
    group's table.
    """
    for index in range(start, end):
        for group, table in enumerate(block_ids):
            if index < len(table) and table[index] != NULL_BLOCK_ID:
                yield index, group, table[index]
