"""The worker side of :class:`~kvconn.testing.memory_connector.MemoryConnector`: ``fail_from_block``.

Kept apart from the connector because it imports torch (through
:mod:`kvconn.store.worker`), which only a worker needs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..context import ConnectorContext
from ..store.metadata import StoreMetadata
from ..store.worker import StoreWorker
from .memory_connector import MemoryConfig
from .memory_store import faults

__all__ = ["MemoryWorker"]

#: What a load injected to fail leaves in its blocks: far outside the reference model's KV range.
GARBAGE = 7.0


class MemoryWorker(StoreWorker):
    """A :class:`~kvconn.store.worker.StoreWorker` whose loads fail from block ``fail_from_block`` on.

    A failing block's value is read back damaged while its load runs (the
    store's ``damaged`` keys), so the store layer's own verification rejects
    it and reports the block; once the load ends the block is filled with
    :data:`GARBAGE`. A key loaded by several requests in one step fails for
    all of them (a step reads each key once).
    """

    config: MemoryConfig

    def __init__(self, config: MemoryConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self._kv_caches: Mapping[str, Any] = {}
        self._damaged: Counter[bytes] = Counter()  # loads in flight failing each key
        #: per request whose load runs: the keys it fails, and the (group, block id) it fills with garbage
        self._failing: dict[str, tuple[list[bytes], list[tuple[int, int]]]] = {}

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._kv_caches = kv_caches

    def start_load_kv(self, metadata: StoreMetadata) -> None:
        fail_from = self.config.fail_from_block
        if fail_from is None or not metadata.loads:
            super().start_load_kv(metadata)
            return
        damaged = faults(self.config.store).damaged
        seen: Counter[tuple[str, int]] = Counter()  # blocks of each request and group so far
        for b in metadata.loads:
            seen[b.req_id, b.group] += 1
            if seen[b.req_id, b.group] > fail_from:
                keys, blocks = self._failing.setdefault(b.req_id, ([], []))
                keys.append(key := self.keys.key(b.group, b.block_hash))
                blocks.append((b.group, b.block_id))
                self._damaged[key] += 1
                damaged.add(key)
        super().start_load_kv(metadata)
        if not metadata.load_async:
            self._ended(self._failing.keys())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = super().get_finished(finished_req_ids)
        if self._failing and recving:
            self._ended(recving & self._failing.keys())
        return sending, recving

    def _ended(self, req_ids: Any) -> None:
        """The loads of ``req_ids`` ended: their keys read back intact again, their failed blocks hold garbage."""
        damaged = faults(self.config.store).damaged
        for req_id in list(req_ids):
            keys, blocks = self._failing.pop(req_id)
            for key in keys:
                self._damaged[key] -= 1
                if not self._damaged[key]:
                    del self._damaged[key]
                    damaged.discard(key)
            for group, block_id in blocks:
                for layer in self.context.kv_cache_groups[group].layer_names:
                    self._kv_caches[layer][block_id].fill_(GARBAGE)
