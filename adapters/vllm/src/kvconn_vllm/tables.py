"""Block tables rebuilt from scheduler outputs, for vLLM without the lazy block state.

vLLM versions before the lazy block-state fix do not set
``SchedulerOutput.kv_connector_block_state``, or (0.29) set it to a dict of
only the requests that got new blocks this step, whose tables are then used
as they are. The adapter offers every
request in ``num_scheduled_tokens`` (the same set the fix offers, minus
state-space boundary hand-offs) and resolves tables it tracks the way vLLM's
workers do:

* a new request: its table is ``NewRequestData.block_ids`` (all groups, prefix
  hits included);
* a request resumed from preemption: ``new_block_ids`` *replaces* its table;
* any other scheduled request: ``new_block_ids`` (if not ``None``) is appended;
  ``None`` — the block-fill step among others — leaves the table as it is,
  which is then still current (vLLM allocated nothing for it);
* ids in ``finished_req_ids`` are dropped.

Safe: full-attention groups, preemption and resume, prefix hits, chunked
prefill, the block-fill step. Not safe: sliding-window groups (vLLM replaces
blocks that left the window with the null block in its cache manager without
telling the workers, so a tracked table can name a block already reused by
another request; the adapter then offers no tables at all), and state-space
(Mamba) boundary hand-offs, which are not offered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvconn.block_state import BlockIds, KVConnectorBlockState
from kvconn.outputs import SchedulerOutput

__all__ = ["TableTracker"]


class TableTracker:
    """Per-request tables, updated from every step's :class:`kvconn.SchedulerOutput`."""

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def update(self, output: SchedulerOutput) -> None:
        """Apply one step; must see every step, in order."""
        for req_id in output.finished_req_ids:
            self._tables.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            self._tables[new.req_id] = [list(t) for t in new.block_ids]
        cached = output.scheduled_cached_reqs
        for req_id, resumed, blocks in zip(
            cached.req_ids, cached.resumed_from_preemption, cached.new_block_ids, strict=True
        ):
            table = self._tables.get(req_id)
            if resumed or table is None:
                self._tables[req_id] = [list(t) for t in blocks or ()]
            elif blocks is not None:
                for group, added in zip(table, blocks, strict=True):
                    group.extend(added)

    def resolve(self, req_id: str) -> BlockIds:
        """A copy of ``req_id``'s tracked table."""
        return tuple(list(t) for t in self._tables[req_id])

    def block_state(
        self, output: SchedulerOutput, snapshot: Mapping[str, Sequence[Sequence[int]]] | None = None
    ) -> KVConnectorBlockState:
        """Offer every scheduled request with a tracked table; ``snapshot``'s tables (vLLM 0.29's) win."""
        if not snapshot:
            return KVConnectorBlockState(set(output.num_scheduled_tokens) & self._tables.keys(), self.resolve)

        def resolve(req_id: str) -> BlockIds:
            table = snapshot.get(req_id)
            return self.resolve(req_id) if table is None else tuple(list(t) for t in table)

        offered = (set(output.num_scheduled_tokens) & self._tables.keys()) | set(snapshot)
        return KVConnectorBlockState(offered, resolve)

    @staticmethod
    def snapshot_state(snapshot: Mapping[str, Sequence[Sequence[int]]]) -> KVConnectorBlockState:
        """Offer only vLLM 0.29's own tables (with sliding windows, where tracked tables are not safe)."""
        return KVConnectorBlockState(set(snapshot), lambda req_id: tuple(list(t) for t in snapshot[req_id]))

    def __len__(self) -> int:
        return len(self._tables)
