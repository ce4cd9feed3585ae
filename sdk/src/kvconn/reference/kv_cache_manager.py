"""Paged KV-cache bookkeeping: per-request block tables over one shared pool.

Each KV-cache group (full attention, sliding window) has its own table per
request. Sliding-window tables hold the null block (id 0) for blocks wholly
outside the window; those are freed as the request advances. A block enters
the prefix cache only once its KV is known to be computed (or loaded): the
scheduler calls :meth:`KVCacheManager.cache_blocks` after each step, so a failed
load never leaves a stale block behind.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..block_state import BlockIds
from ..context import KVCacheGroupSpec
from .block_pool import Block, BlockPool
from .request import Request

__all__ = ["KVCacheManager"]


class KVCacheManager:
    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        *,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.groups = tuple(groups)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[list[Block]]] = {}
        self._num_cached: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ queries

    def get_block_ids(self, req_id: str) -> BlockIds:
        """The live table of ``req_id``: one list of block ids per group."""
        tables = self._tables.get(req_id)
        if tables is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in table] for table in tables)

    def has_request(self, req_id: str) -> bool:
        return req_id in self._tables

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _first_needed_block(self, group: int, num_computed_tokens: int) -> int:
        """Blocks before this index are outside the window of the next token."""
        return self.groups[group].first_needed_block(num_computed_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[Block]], int]:
        """Longest prefix of ``request`` in the local cache: per-group blocks and tokens.

        At least one token is always left to compute.
        """
        groups = range(len(self.groups))
        if not self.enable_prefix_caching:
            return [[] for _ in groups], 0
        hashes = request.block_hashes
        n = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        for g in groups:
            if self.groups[g].sliding_window is None:
                k = 0
                while k < n and self.pool.lookup(g, hashes[k]) is not None:
                    k += 1
                n = k
        for g in groups:
            if self.groups[g].sliding_window is not None:
                while n > 0 and any(
                    self.pool.lookup(g, hashes[i]) is None
                    for i in range(self._first_needed_block(g, n * self.block_size), n)
                ):
                    n -= 1
        blocks: list[list[Block]] = []
        for g in groups:
            skip = self._first_needed_block(g, n * self.block_size)
            blocks.append([self.pool.null_block if i < skip else self.pool.lookup(g, hashes[i]) for i in range(n)])  # type: ignore[misc]
        return blocks, n * self.block_size

    # -------------------------------------------------------------- allocation

    def allocate_slots(
        self,
        request: Request,
        num_tokens: int,
        *,
        num_computed_tokens: int,
        computed_blocks: list[list[Block]] | None = None,
    ) -> BlockIds | None:
        """Grow ``request``'s tables to cover ``num_tokens`` tokens.

        ``computed_blocks`` (prefix hits) seed the tables of a request that has
        none. Sliding-window blocks wholly before the window of position
        ``num_computed_tokens`` are the null block. Returns the ids appended
        per group (empty lists if none), or ``None`` if the pool has no room.
        """
        tables = self._tables.get(request.request_id)
        base = tables if tables is not None else (computed_blocks or [[] for _ in self.groups])
        required = -(-num_tokens // self.block_size)
        plans: list[tuple[int, int]] = []  # per group: (null entries, real blocks) to append
        # Prefix hits that sit in the free queue leave it when taken: they count against the room too.
        need = 0
        if tables is None:
            need = sum(1 for t in base for b in t if b.ref_cnt == 0 and b is not self.pool.null_block)
        for g, table in enumerate(base):
            missing = max(0, required - len(table))
            nulls = min(missing, max(0, self._first_needed_block(g, num_computed_tokens) - len(table)))
            plans.append((nulls, missing - nulls))
            need += missing - nulls
        if need > self.pool.num_free_blocks:
            return None
        if tables is None:
            self.pool.touch(b for table in base for b in table)
            tables = [list(table) for table in base]
            self._tables[request.request_id] = tables
            self._num_cached[request.request_id] = [len(table) for table in tables]
        new_ids: list[list[int]] = []
        for table, (nulls, real) in zip(tables, plans, strict=True):
            added = [self.pool.null_block] * nulls + self.pool.allocate(real)
            table.extend(added)
            new_ids.append([b.block_id for b in added])
        return tuple(new_ids)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free sliding-window blocks the request will never read again."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        for g, table in enumerate(tables):
            for i in range(self._first_needed_block(g, request.num_computed_tokens)):
                if table[i] is not self.pool.null_block:
                    self.pool.free([table[i]])
                    table[i] = self.pool.null_block

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        num_cached = self._num_cached[request.request_id]
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        for g, table in enumerate(tables):
            for i in range(num_cached[g], min(num_full, len(table))):
                if table[i] is not self.pool.null_block:
                    self.pool.cache(g, table[i], request.block_hashes[i])
            num_cached[g] = max(num_cached[g], num_full)

    def invalidate_from(self, request: Request, block_index: int) -> None:
        """Drop the request's blocks from ``block_index`` on from the prefix cache."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        for g, table in enumerate(tables):
            for block in table[block_index:]:
                if block is not self.pool.null_block and block.ref_cnt == 1:
                    self.pool.uncache(block)
            self._num_cached[request.request_id][g] = min(self._num_cached[request.request_id][g], block_index)

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (tail first, so prefixes live longest)."""
        tables = self._tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if tables is not None:
            self.pool.free(b for table in tables for b in reversed(table))

    def num_requests(self) -> int:
        return len(self._tables)
