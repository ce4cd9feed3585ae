"""Scheduler side: what to load on a prefix hit, and which blocks to save when.

Saving: a block is saved on the step that *fills* it, which is often a step
that allocates no block; its table comes from ``block_state.get_block_ids``,
which offers every scheduled request. Each request keeps a cursor,
``saved_upto``: blocks before it are saved (or were not computed here). Each
step the cursor first drops back to the first block the step (re)computes, so
blocks recomputed after a failed load are saved again, then moves to the last
full block after the step. A request that loads on a step saves nothing on
that step (what it computes may rest on a load that fails); its blocks are
saved on its next step, or, if it finishes on that step, on the following one
while its blocks are held (``request_finished`` delays the free).

Loading: ``batch_is_exist`` on the chained-hash keys of the blocks after the
local hit; the hit is the longest run of blocks present in every full-attention
group, shortened until every sliding-window group has the blocks its window
needs. Lookups are memoised for the step, as ``get_num_new_matched_tokens``
may be asked again for the same request. A block whose load failed is not
claimed again for :data:`FAILED_BLOCK_COOLDOWN_STEPS` steps: vLLM asks again at
once after a failed load it sees as async (with several KV-cache groups, every
load), and claiming the same bad value again would livelock the request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvconn import (
    BlockIds,
    ConnectorContext,
    ConnectorRequest,
    KVConnectorBlockState,
    KVConnectorOutput,
    SchedulerOutput,
    filled_blocks,
    iter_block_ids,
)

from .backends import StoreLease, StoreSide
from .config import MooncakeConfig
from .degrade import Degradations
from .metadata import BlockTransfer, MooncakeMetadata

__all__ = ["SchedulerSide"]


#: Steps during which a block whose load failed is not claimed again (the store layer's default cooldown).
FAILED_BLOCK_COOLDOWN_STEPS = 1000


@dataclass
class _Request:
    request: ConnectorRequest
    saved_upto: int
    loads: list[BlockTransfer] = field(default_factory=list)


class SchedulerSide(StoreSide):
    """The scheduler side of ``mooncake``: store lookups, and the loads and saves each step sends."""

    def __init__(self, config: MooncakeConfig, context: ConnectorContext, lease: StoreLease | None = None) -> None:
        super().__init__(config, context, lease)
        self.block_size = context.block_size
        self.groups = context.kv_cache_groups
        self.save_decode_cache = config.save_decode_cache
        self.degraded = Degradations()
        self._requests: dict[str, _Request] = {}
        self._lookups: dict[str, tuple[tuple[int, int], int]] = {}  # this step's lookups
        self._final: dict[str, list[BlockTransfer]] = {}  # finished, saves not yet sent
        self._sending: set[str] = set()  # finished, saves sent, worker not done yet
        self._committed: set[str] = set()  # requests whose load goes out in the next metadata
        self._step = 0
        self._loading: dict[str, list[tuple[int, bytes]]] = {}  # loads sent, not yet reported: (block id, hash)
        self._cooling: dict[bytes, int] = {}  # block hash -> the step until which it is not claimed

    # ---------------------------------------------------------------- lookups

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """The stored blocks after the local hit, in tokens; loaded synchronously (no side effects)."""
        bs = self.block_size
        if num_computed_tokens % bs:
            return 0, False
        start = num_computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # leave a token to compute
        if end <= start:
            return 0, False
        memo = self._lookups.get(request.request_id)
        if memo is not None and memo[0] == (start, end):
            return memo[1], False
        hit = self._lookup(request.block_hashes, start, end)
        tokens = (hit - start) * bs
        self._lookups[request.request_id] = ((start, end), tokens)
        return tokens, False

    def _lookup(self, hashes: Sequence[bytes], start: int, end: int) -> int:
        """The end of the longest run of blocks from ``start`` that every group can load (none cooling)."""
        end = next((i for i in range(start, end) if self._cooling.get(hashes[i], 0) > self._step), end)
        if end <= start:
            return start
        groups = range(len(self.groups))
        keys = [self.keys.key(g, hashes[i]) for g in groups for i in range(start, end)]
        codes = self.store.batch_is_exist(keys)
        errors = sum(1 for c in codes if c < 0)
        self.degraded.record(
            "lookup_errors", errors, "batch_is_exist failed (e.g. master down); those blocks count as misses"
        )
        width = end - start
        present = [[codes[g * width + i] == 1 for i in range(width)] for g in groups]
        hit = end
        for g in groups:
            if self.groups[g].sliding_window is None:
                hit = min(hit, start + next((i for i, ok in enumerate(present[g]) if not ok), width))
        while hit > start and not all(
            present[g][i - start]
            for g in groups
            if self.groups[g].sliding_window is not None
            for i in self._window(g, start, hit)
        ):
            hit -= 1
        return hit

    def _window(self, group: int, start: int, end: int) -> range:
        """Blocks of ``[start, end)`` a sliding-window group needs once ``end`` blocks are computed."""
        first = self.groups[group].first_needed_block(end * self.block_size, self.block_size)
        return range(max(start, first), end)

    # -------------------------------------------------------------- requests

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        """Start tracking ``request``; plan its load when it is the one loading."""
        bs = self.block_size
        first = request.num_computed_tokens // bs
        last = first + num_external_tokens // bs
        loads = list(self._transfers(request, block_ids, first, last))
        self._requests[request.request_id] = _Request(request, saved_upto=last, loads=loads)
        if loads:
            self._committed.add(request.request_id)
            self._loading[request.request_id] = [
                (block_id, request.block_hashes[i]) for i, _, block_id in iter_block_ids(block_ids, first, last)
            ]

    def _transfers(self, request: ConnectorRequest, table: BlockIds, start: int, end: int) -> Iterator[BlockTransfer]:
        hashes = request.block_hashes
        for i, g, block_id in iter_block_ids(table, start, end):
            yield BlockTransfer(self.keys.key(g, hashes[i]), block_id, g)

    def _save_limit(self, request: ConnectorRequest, full_blocks: int) -> int:
        """One past the last block that may be saved once its first ``full_blocks`` blocks are computed."""
        limit = min(full_blocks, len(request.block_hashes))
        if not self.save_decode_cache:
            limit = min(limit, len(request.prompt_token_ids) // self.block_size)
        return limit

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> MooncakeMetadata:
        self._step += 1
        self._lookups.clear()
        meta = MooncakeMetadata()
        loading: set[str] = set()
        # Every committed load goes out now, its request scheduled this step or not (vLLM with several KV-cache
        # groups holds a request back until its load is reported, see update_state_after_alloc's contract).
        for req_id in self._committed:
            state = self._requests.get(req_id)
            if state is not None and state.loads:
                meta.loads.extend(state.loads)
                state.loads = []
                loading.add(req_id)
        self._committed.clear()
        for req_id, start, end in filled_blocks(scheduler_output, self.block_size):
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.saved_upto = min(state.saved_upto, start)
            limit = self._save_limit(state.request, end)
            if req_id in loading or limit <= state.saved_upto:
                continue
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue
            meta.saves.extend(self._transfers(state.request, table, state.saved_upto, limit))
            state.saved_upto = limit
        for req_id, transfers in self._final.items():
            meta.saves.extend(transfers)
            meta.finished_saves.append(req_id)
            self._sending.add(req_id)
        self._final.clear()
        meta.saves = _unique(meta.saves)
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: BlockIds) -> bool:
        """Forget ``request``; hold its blocks if computed blocks are still unsaved (a load step)."""
        self._lookups.pop(request.request_id, None)
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False
        limit = self._save_limit(request, request.num_computed_tokens // self.block_size)
        transfers = list(self._transfers(request, block_ids, state.saved_upto, limit))
        if not transfers:
            return False
        self._final[request.request_id] = transfers
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Loads end with the step their metadata went in (synchronous); their failed blocks start cooling."""
        failed, until = connector_output.invalid_block_ids, self._step + FAILED_BLOCK_COOLDOWN_STEPS
        for req_id in [r for r in self._loading if r not in self._committed]:  # sent: reported now
            for block_id, block_hash in self._loading.pop(req_id):
                if connector_output.failed or block_id in failed:
                    self._cooling[block_hash] = until
        if self._cooling:
            self._cooling = {h: u for h, u in self._cooling.items() if u > self._step}
        self._sending -= connector_output.finished_sending
        if connector_output.failed:
            self._sending.clear()  # the host releases what a failed worker side held

    def get_num_tracked_requests(self) -> int:
        return len(self._requests) + len(self._final) + len(self._sending)


def _unique(transfers: list[BlockTransfer]) -> list[BlockTransfer]:
    """Drop repeated keys (two requests computing the same prefix in one step save it once)."""
    first: dict[str, BlockTransfer] = {}
    for transfer in transfers:
        first.setdefault(transfer.key, transfer)
    return list(first.values())
