"""What crosses between scheduler and workers each step (msgspec Structs).

Shapes follow vLLM's v1 engine so connector authors recognise them.
``SchedulerOutput.kv_connector_block_state`` is the one field that never goes
on the wire: it is set only while connectors build metadata.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from .block_state import BlockIds, KVConnectorBlockState
from .metadata import KVConnectorMetadata

__all__ = [
    "CachedRequestData",
    "KVConnectorOutput",
    "ModelRunnerOutput",
    "NewRequestData",
    "SchedulerOutput",
]


class NewRequestData(msgspec.Struct):
    """A request scheduled for the first time; ``adapter``: the LoRA adapter it runs under, if any."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: BlockIds
    num_computed_tokens: int
    adapter: str | None = None


class CachedRequestData(msgspec.Struct):
    """Requests the workers already know, one entry per list position.

    ``new_block_ids[i]`` is ``None`` on a step that allocated no block for the
    request (the block-fill step is one), and the *whole* new table when it
    was resumed from preemption. ``new_token_ids[i]`` are the tokens appended
    to the request since it was last scheduled. ``all_token_ids`` holds every
    token of the resumed requests.

    Plugins read it and never change it: an engine may hand over read-only
    sequences (vLLM's adapter does: views over vLLM's own lists, with
    ``new_block_ids`` entries copied as they are read), so that kvconn's cost
    per step does not grow with the batch.
    """

    req_ids: Sequence[str] = msgspec.field(default_factory=list)
    resumed_from_preemption: Sequence[bool] = msgspec.field(default_factory=list)
    new_token_ids: Sequence[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: Sequence[BlockIds | None] = msgspec.field(default_factory=list)
    num_computed_tokens: Sequence[int] = msgspec.field(default_factory=list)
    all_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)


class SchedulerOutput(msgspec.Struct):
    """One engine step, as decided by the scheduler (read-only for plugins, as :class:`CachedRequestData`)."""

    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: Mapping[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = msgspec.field(default_factory=set)
    #: Per connector name, that connector's metadata for this step.
    kv_connector_metadata: dict[str, KVConnectorMetadata] | None = None
    #: Set only while connectors build metadata (legacy access); never sent.
    kv_connector_block_state: KVConnectorBlockState | None = None

    def num_computed_tokens_by_request(self) -> dict[str, int]:
        """``num_computed_tokens`` at the start of this step, for every scheduled request.

        This step computes tokens ``[n, n + num_scheduled_tokens[req_id])``, so
        the blocks it fills are easy to derive (what a saving connector needs).
        """
        cached = self.scheduled_cached_reqs
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        computed.update((new.req_id, new.num_computed_tokens) for new in self.scheduled_new_reqs)
        return computed


class KVConnectorOutput(msgspec.Struct):
    """What one connector's worker side reports after a step.

    ``failed`` is set by the host when the connector raised on the worker this
    step: its loads in flight are then treated as failed and recomputed.
    """

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    failed: bool = False
    stats: dict[str, float] = msgspec.field(default_factory=dict)

    def is_empty(self) -> bool:
        """Whether it reports nothing (no transfer ended, no error, no stats): most steps of most connectors."""
        return not (
            self.finished_sending or self.finished_recving or self.invalid_block_ids or self.failed or self.stats
        )


class ModelRunnerOutput(msgspec.Struct):
    """The workers' answer to one ``SchedulerOutput``.

    ``sampled_token_ids[req_id]`` is empty for a request whose prompt is not
    fully computed yet (a chunked-prefill step).
    """

    req_ids: list[str]
    sampled_token_ids: dict[str, list[int]]
    kv_connector_output: dict[str, KVConnectorOutput] = msgspec.field(default_factory=dict)
