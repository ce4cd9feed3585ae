"""Reading a trace step by step: what each request did, and what the connector referenced."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...block_state import BlockIds
from ...context import NULL_BLOCK_ID
from ...outputs import SchedulerOutput
from .metadata_blocks import BlockRefs, block_refs
from .scenarios import Trace

__all__ = ["StepView", "completing_a_block", "live_ids", "step_views"]


@dataclass
class StepView:
    """One step of a trace, classified.

    ``fill``: cached requests that got no new block on a step that completes
    their last block (the block-fill step). ``grow``: cached requests, not back
    from preemption, whose table grew. ``refs``: the block ids the connector's
    metadata carries, per request.
    """

    index: int
    refs: BlockRefs
    fill: set[str] = field(default_factory=set)
    grow: set[str] = field(default_factory=set)


def live_ids(table: BlockIds | None) -> set[int]:
    """The real (non-null) block ids of a table."""
    return {b for group in table or () for b in group if b != NULL_BLOCK_ID}


def completing_a_block(output: SchedulerOutput, block_size: int) -> set[str]:
    """The requests whose step completes at least one of their blocks (those a full-block saver acts on)."""
    computed = output.num_computed_tokens_by_request()
    return {
        r for r, n in output.num_scheduled_tokens.items() if (computed[r] + n) // block_size > computed[r] // block_size
    }


def step_views(trace: Trace) -> list[StepView]:
    """Classify every recorded step of ``trace``."""
    bs = trace.block_size
    tokens: dict[str, set[int]] = {}
    requests = set(trace.request_ids)
    views: list[StepView] = []
    for index, record in enumerate(trace.records):
        out = record.output
        for new in out.scheduled_new_reqs:
            tokens[new.req_id] = set(new.prompt_token_ids)
        cached = out.scheduled_cached_reqs
        for req_id, added in zip(cached.req_ids, cached.new_token_ids, strict=True):
            tokens.setdefault(req_id, set()).update(added)
        for req_id, all_ids in cached.all_token_ids.items():
            tokens[req_id] = set(all_ids)
        meta = record.metadata
        refs = (
            block_refs(meta, requests=requests, num_blocks=trace.num_blocks, tokens=tokens) if meta is not None else {}
        )
        view = StepView(index, refs)
        for i, req_id in enumerate(cached.req_ids):
            added_blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                continue  # a new table, neither grown nor filled
            if added_blocks is not None and any(added_blocks):
                view.grow.add(req_id)
            elif (cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id]) % bs == 0:
                view.fill.add(req_id)
        views.append(view)
    return views
