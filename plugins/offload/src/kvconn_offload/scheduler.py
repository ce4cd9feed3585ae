"""Scheduler side: decides what to store and load, over the :class:`OffloadManager`.

* Store: on every step, for every scheduled request, the offloaded blocks whose
  last token is computed by this step (never a partial one), with the device
  blocks read from the live table (``block_state.get_block_ids``) - so a table
  rebuilt by preemption is never stale. One store job per step, numbered; the
  worker reports the highest finished job and its blocks become loadable.
* Load: ``get_num_new_matched_tokens`` reports the longest ready prefix in whole
  offloaded blocks (no side effects), async or not as ``load_async`` says; its
  ``auto`` follows the worker's first report: sync where its copies block the
  step either way (KV caches in host memory: an async hit would only wait a
  step more), async where they run on a CUDA side stream. No hit precedes that
  report: a block is loadable only once a report says its store job is done;
  ``update_state_after_alloc`` pins its entries and plans the copies for the
  blocks actually allocated. An async load ends when the worker reports it in
  ``finished_recving``; a step's sync loads are numbered and end when the
  worker reports their number run (as store jobs).
* Sliding-window groups: the engine allocates the null block for blocks before
  the window of the hit point, so only blocks inside it are loaded, and a hit
  is shortened until every such block was saved for that group.
* Free: a finished request whose store job is still running keeps its blocks
  (``request_finished`` returns True) until the worker reports it sent.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvconn import (
    BlockIds,
    ConnectorContext,
    ConnectorRequest,
    KVConnectorBlockState,
    KVConnectorOutput,
    SaveCursor,
    SchedulerOutput,
    iter_block_ids,
    loadable_hit,
)
from kvconn.telemetry import BlockRemoved, BlockStored, KVEvent

from .config import OffloadConfig
from .manager import OffloadManager
from .metadata import BlockTransfer, OffloadMetadata

__all__ = ["BLOCKING_COPIES_STAT", "LOADS_DONE_STAT", "POOL_SLOTS_STAT", "STORES_DONE_STAT", "OffloadScheduler"]

logger = logging.getLogger("kvconn_offload")

#: Worker stats keys the scheduler side reads (beyond the engine's summed counters).
#: Private (``_``) keys: gauges, which engines neither sum nor show (see ``get_kv_connector_stats``).
STORES_DONE_STAT = "_stores_done"
LOADS_DONE_STAT = "_loads_done"
POOL_SLOTS_STAT = "_pool_slots"
#: 1 when the worker's copies block the step (KV caches in host memory: no copy stream), 0 when they run on a
#: CUDA side stream: what ``load_async: auto`` follows.
BLOCKING_COPIES_STAT = "_blocking_copies"


@dataclass
class _InFlight:
    """A load the worker runs: the keys it pinned, the key each device block reads, and keys found stale."""

    keys: list[bytes] = field(default_factory=list)
    key_of_block: dict[int, bytes] = field(default_factory=dict)
    #: keys whose slot did not hold them when the worker read it (a store the worker dropped): forgotten once
    #: the load ends, so later lookups stop offering them
    stale: set[bytes] = field(default_factory=set)


class OffloadScheduler:
    """The scheduler side of ``offload``: the pool index, and the copies each step plans."""

    def __init__(self, config: OffloadConfig, context: ConnectorContext) -> None:
        self.block_size = context.block_size
        self.multiple = config.block_size_multiple
        self.groups = context.kv_cache_groups
        self.policy = config.eviction
        self.load_async = config.load_async is not False  # auto: async until the worker reports its copies
        self._auto_load_async = config.load_async == "auto"
        slots = config.num_slots
        self.manager: OffloadManager | None = OffloadManager(slots, policy=self.policy) if slots else None
        self._requests: dict[str, ConnectorRequest] = {}
        self.cursor = SaveCursor()
        self._loads: dict[str, _InFlight] = {}
        self._new_loads: list[BlockTransfer] = []
        self._store_jobs: deque[tuple[int, list[bytes]]] = deque()
        self._next_seq = 1
        self._done_seq = 0
        self._last_store: dict[str, int] = {}
        self._delayed: set[str] = set()
        self._new_delayed: list[str] = []
        self._sync_loads: deque[tuple[int, list[str]]] = deque()  # sync load batches sent: number, requests
        self._next_load_seq = 1
        self._evictions_reported = 0
        self._events_taken = False  # an engine takes events: the pool records its changes from its creation

    # -------------------------------------------------------------- telemetry

    def scheduler_stats(self) -> dict[str, float]:
        """The pool's occupancy (gauges) and the evictions since the last call (``OffloadConnector.metrics``)."""
        manager = self.manager
        if manager is None:
            return {}
        evicted, self._evictions_reported = manager.evictions - self._evictions_reported, manager.evictions
        return {"pool_used_blocks": len(manager), "pool_blocks": manager.num_slots, "evictions": evicted}

    def take_events(self) -> list[KVEvent]:
        """Offloaded blocks that became loadable, and those evicted or found stale, since the last call.

        An offloaded block is named by the hash of its last engine block (``block_size_multiple`` engine blocks).
        """
        self._events_taken = True
        if self.manager is None:
            return []
        stored, removed = self.manager.take_changes()
        events: list[KVEvent] = []
        if stored:
            events.append(BlockStored(stored, self.block_size * self.multiple))
        if removed:
            events.append(BlockRemoved(removed))
        return events

    # ----------------------------------------------------------------- lookup

    def _keys(self, request: ConnectorRequest, start: int, end: int) -> list[bytes]:
        """Keys of the offloaded blocks ``start <= k < end`` whose last engine block has a hash.

        Only that range is built, so a decode step's store plan costs its new blocks, not the context.
        """
        hashes, m = request.block_hashes, self.multiple
        return [hashes[(k + 1) * m - 1] for k in range(start, min(end, len(hashes) // m))]

    def _hit_blocks(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """Offloaded blocks of the longest loadable prefix: every engine block it loads saved, in every group."""
        manager = self.manager
        if manager is None:
            return 0
        bs, m = self.block_size, self.multiple
        keys = self._keys(request, 0, (request.num_tokens - 1) // (bs * m))

        def saved(group: int, i: int) -> bool:
            entry = manager.get(keys[i // m])
            return entry is not None and bool(entry.valid[group] >> (i % m) & 1)

        end = manager.lookup(keys) * m
        return loadable_hit(self.groups, bs, num_computed_tokens // bs, end, saved, step=m) // m

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        hit = self._hit_blocks(request, num_computed_tokens) * self.multiple * self.block_size - num_computed_tokens
        return (hit, self.load_async) if hit > 0 else (0, False)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request
        self.cursor.start(request.request_id, 0)  # blocks already offloaded are skipped by key
        if not num_external_tokens or self.manager is None:
            return
        bs, m = self.block_size, self.multiple
        first = request.num_computed_tokens // bs
        end = (request.num_computed_tokens + num_external_tokens) // bs
        keys = self._keys(request, 0, -(-end // m))
        used = keys[first // m :]
        transfer = BlockTransfer(request.request_id, [[] for _ in block_ids], [[] for _ in block_ids])
        load = _InFlight()
        for i, g, device in iter_block_ids(block_ids, first, end):
            entry = self.manager.get(keys[i // m]) if i // m < len(keys) else None
            if entry is None or not entry.ready or not entry.valid[g] >> (i % m) & 1:
                transfer.failed_blocks.append(device)
                continue
            load.key_of_block[device] = keys[i // m]
            transfer.device_blocks[g].append(device)
            transfer.host_blocks[g].append(entry.slot * m + i % m)
        present = [(key, entry) for key in used if (entry := self.manager.get(key)) is not None]
        transfer.keys = [key for key, _ in present]
        transfer.slots = [entry.slot for _, entry in present]
        self.manager.prepare_load(transfer.keys)
        self.manager.touch(keys)
        load.keys = transfer.keys
        self._loads[request.request_id] = load
        self._new_loads.append(transfer)

    # ------------------------------------------------------------------ store

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> OffloadMetadata:
        meta = OffloadMetadata(loads=self._new_loads, delayed_frees=self._new_delayed)
        self._new_loads, self._new_delayed = [], []
        if meta.loads and not self.load_async:
            meta.load_seq = self._next_load_seq
            self._next_load_seq += 1
            self._sync_loads.append((meta.load_seq, [transfer.req_id for transfer in meta.loads]))
        if self.manager is None:
            return meta
        stored: list[bytes] = []
        for req_id, first, end in list(self.cursor.due(scheduler_output, self.block_size * self.multiple)):
            keys = self._keys(self._requests[req_id], first, end)
            table = None
            if any(self.manager.get(key) is None for key in keys):  # the table is resolved only when needed
                table = block_state.get_block_ids(req_id)
                if table is None:
                    continue  # not offered this step: stored on a later one
            self.cursor.advance(req_id, end)
            transfer = self._plan_store(req_id, table, first, keys) if table is not None else None
            if transfer is not None:
                meta.stores.append(transfer)
                stored.extend(transfer.keys)
        if stored:
            meta.store_seq = self._next_seq
            self._next_seq += 1
            self._store_jobs.append((meta.store_seq, stored))
            for transfer in meta.stores:
                self._last_store[transfer.req_id] = meta.store_seq
        return meta

    def _plan_store(self, req_id: str, table: BlockIds, first: int, keys: list[bytes]) -> BlockTransfer | None:
        """Of the offloaded blocks from ``first`` on (``keys``), those not offloaded yet, with their device blocks."""
        manager = self.manager
        assert manager is not None
        m = self.multiple
        new = manager.prepare_store(keys)
        if not new:
            return None
        index = {key: first + i for i, key in enumerate(keys)}
        transfer = BlockTransfer(req_id, [[] for _ in table], [[] for _ in table])
        for key, entry in new:
            k = index[key]
            entry.valid = [0] * len(table)
            for i, g, device in iter_block_ids(table, k * m, (k + 1) * m):
                transfer.device_blocks[g].append(device)
                transfer.host_blocks[g].append(entry.slot * m + i % m)
                entry.valid[g] |= 1 << i % m
            transfer.slots.append(entry.slot)
            transfer.keys.append(key)
        return transfer

    # ---------------------------------------------------------------- reports

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stats = connector_output.stats
        if self._auto_load_async and BLOCKING_COPIES_STAT in stats:
            self.load_async, self._auto_load_async = not stats[BLOCKING_COPIES_STAT], False
        if self.manager is None and stats.get(POOL_SLOTS_STAT):
            self.manager = OffloadManager(int(stats[POOL_SLOTS_STAT]), policy=self.policy)
            if self._events_taken:
                self.manager.record_changes()
            logger.info("offload pool: %d offloaded blocks (reported by the worker)", self.manager.num_slots)
        self._done_seq = max(self._done_seq, int(stats.get(STORES_DONE_STAT, 0)))
        while self._store_jobs and self._store_jobs[0][0] <= self._done_seq:
            _, keys = self._store_jobs.popleft()
            if self.manager is not None:
                self.manager.complete_store(keys)
        if invalid := connector_output.invalid_block_ids:  # blocks the worker could not load: stale slots
            for load in self._loads.values():
                load.stale.update(load.key_of_block[b] for b in invalid & load.key_of_block.keys())
        finished = set(self._loads) if connector_output.failed else set(connector_output.finished_recving)
        loads_done = int(stats.get(LOADS_DONE_STAT, 0))
        while self._sync_loads and (connector_output.failed or self._sync_loads[0][0] <= loads_done):
            finished.update(self._sync_loads.popleft()[1])
        for req_id in finished & self._loads.keys():
            load = self._loads.pop(req_id)
            if self.manager is not None:
                self.manager.complete_load(load.keys)
                self.manager.forget(load.stale)
        for req_id in connector_output.finished_sending:
            self._delayed.discard(req_id)

    def request_finished(self, request: ConnectorRequest) -> bool:
        """Keep the blocks while a store job reading them runs."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self.cursor.forget(req_id)
        if self._last_store.pop(req_id, 0) > self._done_seq:
            self._delayed.add(req_id)
            self._new_delayed.append(req_id)
            return True
        return False

    def get_num_tracked_requests(self) -> int:
        return len(set(self._requests) | set(self._loads) | self._delayed)
