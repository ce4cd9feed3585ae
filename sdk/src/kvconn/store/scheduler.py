"""Scheduler side of a store connector: lookups, and the loads and saves each step sends.

* Lookup (``get_num_new_matched_tokens``): one batched ``contains`` over the
  blocks after the local hit, every group; the hit is cut by
  :func:`kvconn.loadable_hit` (sliding windows) and at the first block whose
  load failed recently. No side effects; memoised for the step (engines ask
  again for the same request).
* A block whose load failed is not offered again for
  ``failed_block_cooldown_steps`` steps. vLLM re-asks the connector as soon as a
  failed async load is rolled back; a connector that offers the same bad value
  again livelocks the request.
* Saves: :class:`kvconn.SaveCursor` over the blocks each step fills, every
  group. A request loading on a step saves nothing that step (what it
  computes may rest on a failed load). A finished request with unsaved
  blocks keeps them (delayed free) until the worker reports their save landed.
* With ``save_async`` a put lands after its step: until its deadline has
  passed, a lookup counts what it saves as stored (the worker settles its put
  in flight before any load, so it reads its own writes; a put that failed
  makes that load fail, and the block is recomputed like an evicted one).
* Events (:meth:`StoreScheduler.take_events`), once an engine asks for them:
  a block is stored once the store confirms every value its save sent (one
  batched ``contains`` per call, over the saves not confirmed yet; a save
  the store still lacks when its put's deadline has passed twice over is
  given up without an event), and removed once a load of it failed (the
  value is gone, failed verification, or the store was off: it is not
  loadable now, and is not offered during its cool-down).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from ..block_state import BlockIds, KVConnectorBlockState
from ..context import ConnectorContext
from ..cursor import SaveCursor
from ..filled import FilledBlocks, iter_block_ids
from ..outputs import KVConnectorOutput, SchedulerOutput
from ..request import ConnectorRequest
from ..telemetry import BlockRemoved, BlockStored, KVEvent
from ..window import loadable_hit
from .config import StoreConfig
from .guard import StoreUnavailable
from .metadata import StoreBlock, StoreMetadata
from .side import StoreSide

__all__ = ["StoreScheduler"]


class StoreScheduler(StoreSide):
    """The scheduler side of every :class:`~kvconn.store.StoreConnector`."""

    def __init__(self, config: StoreConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.block_size = context.block_size
        self.groups = context.kv_cache_groups
        self.cursor = SaveCursor()
        self._requests: dict[str, ConnectorRequest] = {}
        self._lookups: dict[str, tuple[tuple[int, int], int]] = {}
        self._loads: list[StoreBlock] = []
        self._loading: dict[str, dict[int, bytes]] = {}  # req_id -> block id -> block hash, loads in flight
        #: block hash -> step until which it is not offered, in that order (the first cools down first)
        self._cooling: dict[bytes, int] = {}
        self._final: dict[str, list[StoreBlock]] = {}  # finished, saves not sent yet
        self._unsent: set[str] = set()  # in _final at the last report: no build_connector_meta ran since
        self._sending: set[str] = set()  # finished, saves sent, not reported landed yet
        #: save_async: (group, block hash) -> when its save went out, oldest first (a lookup counts it stored)
        self._in_flight: dict[tuple[int, bytes], float] = {}
        self._step = 0
        #: once an engine takes events: (group, block hash) -> until when a save sent is awaited in the store
        self._unconfirmed: dict[tuple[int, bytes], float] | None = None
        self._removed: list[bytes] = []  # blocks whose load failed since the last take_events

    def scheduler_stats(self) -> dict[str, float]:
        """What degraded on this side since the last call (failed lookups, saves never sent), for engine telemetry."""
        return self.stats.take()

    def take_events(self) -> list[KVEvent]:
        """The blocks the store confirmed stored, and those whose load failed, since the last call.

        Only an engine that publishes events calls it; this side records nothing
        (no cost, no store call) until its first call, which returns no event.
        """
        if self._unconfirmed is None:
            self._unconfirmed = {}
            return []
        events: list[KVEvent] = []
        if self._unconfirmed and (stored := self._confirm_saves()):
            events.append(BlockStored(stored, self.block_size))
        if self._removed:
            events.append(BlockRemoved(list(dict.fromkeys(self._removed))))  # one per block, not per group
            self._removed = []
        return events

    def _confirm_saves(self) -> list[bytes]:
        """The blocks whose every value sent for saving the store now holds; forget those given up.

        A store that cannot answer confirms nothing: its saves are asked again on the next call, until their
        deadline.
        """
        pending = self._unconfirmed
        assert pending is not None
        sent = list(pending)
        keys = [self.keys.key(group, block_hash) for group, block_hash in sent]
        try:
            present = self.guard.call("contains", lambda store: list(store.contains(keys)))
        except StoreUnavailable:
            present = [False] * len(keys)
        now = time.monotonic()
        waiting: set[bytes] = set()
        given_up: set[bytes] = set()
        for key, held in zip(sent, present, strict=True):
            if not held:
                (waiting if pending[key] > now else given_up).add(key[1])
        waiting -= given_up
        self._unconfirmed = {key: until for key, until in pending.items() if key[1] in waiting}
        return [h for h in dict.fromkeys(h for _, h in sent) if h not in waiting and h not in given_up]

    # ---------------------------------------------------------------- lookup

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # leave a token to compute
        if num_computed_tokens % bs or end <= start:
            return 0, False
        memo = self._lookups.get(request.request_id)
        if memo is None or memo[0] != (start, end):
            memo = self._lookups[request.request_id] = ((start, end), self._lookup(request.block_hashes, start, end))
        tokens = (memo[1] - start) * bs
        return tokens, tokens > 0 and self.config.load_async

    def _lookup(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """The end of the longest run of blocks from ``start`` that every group can load."""
        if self._cooling:
            cooling = [self._cooling.get(hashes[i], 0) > self._step for i in range(start, end)]
            if True in cooling:
                end = start + cooling.index(True)
        keys = [prefix + block_hash for prefix in self.keys.prefixes for block_hash in hashes[start:end]]
        if not keys:
            return start
        try:
            present = self.guard.call("contains", lambda store: list(store.contains(keys)))
        except StoreUnavailable:
            self.stats.degraded("lookup_failed", len(keys), "lookups failed (store off or late): counted as misses")
            return start
        width = end - start
        if self._in_flight:
            self._forget_landed()
            saving = self._in_flight
            present = [ok or (g, hashes[start + j]) in saving for g in range(len(self.groups))
                       for j, ok in enumerate(present[g * width : (g + 1) * width])]  # fmt: skip
        return loadable_hit(self.groups, self.block_size, start, end, lambda g, i: present[g * width + i - start])

    def _forget_landed(self) -> None:
        """Drop the in-flight saves whose put's deadline has passed: it returned, or failed, by now."""
        horizon = time.monotonic() - self.config.timeout_s
        saving = self._in_flight
        while saving and next(iter(saving.values())) < horizon:
            del saving[next(iter(saving))]

    # -------------------------------------------------------------- requests

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._requests[request.request_id] = request
        self.cursor.start(request.request_id, last)
        loads = list(self._blocks(request, block_ids, first, last))
        if loads:
            self._loads += loads
            self._loading[request.request_id] = {b.block_id: b.block_hash for b in loads}

    def _blocks(self, request: ConnectorRequest, table: BlockIds, start: int, end: int) -> Iterator[StoreBlock]:
        hashes = request.block_hashes
        for i, g, block_id in iter_block_ids(table, start, end):
            yield StoreBlock(request.request_id, g, block_id, hashes[i])

    def _save_limit(self, request: ConnectorRequest, full_blocks: int) -> int:
        limit = min(full_blocks, len(request.block_hashes))
        if not self.config.save_decode:
            limit = min(limit, len(request.prompt_token_ids) // self.block_size)
        return limit

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> StoreMetadata:
        self._step += 1
        self._lookups.clear()
        meta = StoreMetadata(loads=self._loads, load_async=self.config.load_async)
        self._loads = []
        loading = {b.req_id for b in meta.loads}

        def limit(filled: FilledBlocks) -> int:
            return self._save_limit(self._requests[filled.req_id], filled.end)

        for req_id, start, end in list(self.cursor.due(scheduler_output, self.block_size, limit)):
            table = None if req_id in loading else block_state.get_block_ids(req_id)
            if table is not None:  # else: saved on a later step
                meta.saves += self._blocks(self._requests[req_id], table, start, end)
                self.cursor.advance(req_id, end)
        for req_id, blocks in self._final.items():
            meta.saves += blocks
            meta.finished_saves.append(req_id)
            self._sending.add(req_id)
        self._final.clear()
        if self.config.save_async and meta.saves:
            self._forget_landed()
            now = time.monotonic()
            for b in meta.saves:
                self._in_flight.pop((b.group, b.block_hash), None)  # re-inserted last: oldest first
                self._in_flight[(b.group, b.block_hash)] = now
        if self._unconfirmed is not None and meta.saves:
            # a put may wait for the one before it (save_async), each within timeout_s
            until = time.monotonic() + 2 * self.config.timeout_s
            self._unconfirmed.update(((b.group, b.block_hash), until) for b in meta.saves)
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> bool:
        """Forget ``request``; hold its blocks while computed blocks are still unsaved."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._requests.pop(req_id, None)
        upto = self.cursor.forget(req_id)
        if upto is None:
            return False
        limit = self._save_limit(request, request.num_computed_tokens // self.block_size)
        blocks = list(self._blocks(request, block_ids, upto, limit))
        if blocks:
            self._final[req_id] = blocks
        return bool(blocks)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._loading:
            self._loads_reported(connector_output)
        if self._final:
            self._drop_unsent()
        cooling = self._cooling
        if cooling and next(iter(cooling.values())) <= self._step:  # the first to cool down is the first in it
            self._cooling = {h: u for h, u in cooling.items() if u > self._step}
        if connector_output.failed:
            self._sending.clear()  # the host releases what a failed worker side held
        elif self._sending:
            self._sending -= connector_output.finished_sending

    def _drop_unsent(self) -> None:
        """Give up the saves of finished requests that a whole step did not send (its metadata failed).

        The host releases their blocks after its stall bound (and may hand them
        to another request), so sending them later could save another
        request's KV under these keys; forgetting them costs only the saves.
        """
        why = "saves of finished requests never went out (build_connector_meta failed): not saved"
        for req_id in self._unsent & self._final.keys():
            self.stats.degraded("save_failed_unsent", len(self._final.pop(req_id)), why)
        self._unsent = set(self._final)

    def _loads_reported(self, connector_output: KVConnectorOutput) -> None:
        """Cool down the blocks whose load failed; forget the loads that ended."""
        failed = connector_output.invalid_block_ids
        until = self._step + self.config.failed_block_cooldown_steps
        done = set(self._loading) if connector_output.failed else connector_output.finished_recving
        for req_id, blocks in list(self._loading.items()):
            for block_id in (blocks.keys() & failed) if not connector_output.failed else blocks:
                self._cooling.pop(blocks[block_id], None)  # re-inserted last: the dict stays in cool-down order
                self._cooling[blocks[block_id]] = until
                if self._unconfirmed is not None and not connector_output.failed:  # the store's answer, not a crash
                    self._removed.append(blocks[block_id])
            if req_id in done or not self.config.load_async:
                del self._loading[req_id]

    def get_num_tracked_requests(self) -> int:
        return len(self._requests.keys() | self._loading.keys() | self._final.keys() | self._sending)
