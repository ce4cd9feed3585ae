"""``MemoryConnector``: an in-process save/load connector for engine tests.

Load it as ``"kvconn.testing.memory_connector:MemoryConnector"``. Scheduler
side: saves every full block on the step that fills it (keyed by block hash),
reports prefix hits, loads sync or async. Worker side: copies blocks to and
from :data:`STORE`, a dict shared by every instance in the process.

Fault injection for recovery tests: ``fail_from_block`` makes the worker write
garbage into the loaded blocks from that index of each load on, and report
them failed; ``fail_hook`` makes the named hook raise.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .. import (
    BlockIds,
    ConnectorRequest,
    KVConnector,
    KVConnectorBlockState,
    KVConnectorMetadata,
    KVConnectorRole,
    SchedulerOutput,
    filled_blocks,
    iter_block_ids,
)
from .._plugins.manager import HOOK_NAMES

__all__ = ["STORE", "MemoryConfig", "MemoryConnector", "MemoryMetadata", "Transfer"]

#: Saved blocks by (layer, group, block hash), shared by every instance.
STORE: dict[tuple[str, int, bytes], Any] = {}


class MemoryConfig(msgspec.Struct, forbid_unknown_fields=True):
    load_async: bool = False
    #: Loads fail from this block of each request's loaded range on (``None``: never).
    fail_from_block: int | None = None
    #: A hook that raises on every call (``""``: none).
    fail_hook: str = ""

    def __post_init__(self) -> None:
        if self.fail_hook and self.fail_hook not in HOOK_NAMES:
            raise ValueError(f"fail_hook {self.fail_hook!r} is not a hook; hooks: {', '.join(sorted(HOOK_NAMES))}")


class Transfer(msgspec.Struct, array_like=True):
    req_id: str
    block_hash: bytes
    group: int
    block_id: int
    index: int  # position of the block in its load (0 for saves)


class MemoryMetadata(KVConnectorMetadata):
    saves: list[Transfer] = msgspec.field(default_factory=list)
    loads: list[Transfer] = msgspec.field(default_factory=list)


class MemoryConnector(KVConnector):
    Config = MemoryConfig
    Metadata = MemoryMetadata
    saves = loads = True
    api_version = "1.0"
    config: MemoryConfig

    def __init__(self, config: MemoryConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._saved: set[bytes] = set()
        self._pending_loads: list[Transfer] = []
        self._hashes: dict[str, list[bytes]] = {}
        self._loading: set[str] = set()
        self._failed: set[int] = set()
        self.kv_caches: dict[str, Any] = {}
        if self.config.fail_hook:
            setattr(self, self.config.fail_hook, self._injected_failure)

    def _injected_failure(self) -> None:
        raise RuntimeError(f"injected failure in {self.config.fail_hook}")

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.context.block_size
        hits = 0
        for h in request.block_hashes[num_computed_tokens // bs :]:
            if h not in self._saved:
                break
            hits += 1
        return hits * bs, self.config.load_async

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        self._hashes[request.request_id] = list(request.block_hashes)
        bs = self.context.block_size
        first = request.num_computed_tokens // bs
        self._pending_loads += [
            Transfer(request.request_id, request.block_hashes[i], g, b, i - first)
            for i, g, b in iter_block_ids(block_ids, first, first + num_external_tokens // bs)
        ]

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> MemoryMetadata:
        meta = MemoryMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id, start, end in filled_blocks(scheduler_output, self.context.block_size):
            hashes = self._hashes.get(req_id)
            if hashes is None:
                continue
            # blocks this step fills, not saved yet: the table is read only for a request that has some
            fills = [i for i in range(start, min(end, len(hashes))) if hashes[i] not in self._saved]
            table = block_state.get_block_ids(req_id) if fills else None
            if table is None:
                continue
            for i in fills:
                self._saved.add(hashes[i])
                meta.saves.extend(Transfer(req_id, hashes[i], g, b, 0) for _, g, b in iter_block_ids(table, i, i + 1))
        return meta

    def request_finished(self, request: ConnectorRequest) -> bool:
        self._hashes.pop(request.request_id, None)
        return False

    def get_num_tracked_requests(self) -> int:
        return len(self._hashes) if self.role is KVConnectorRole.SCHEDULER else len(self._loading)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches
        self._group_of = self.context.group_of_layer()

    def start_load_kv(self, metadata: MemoryMetadata) -> None:
        for t in metadata.loads:
            for layer in self.context.kv_cache_groups[t.group].layer_names:
                kv = self.kv_caches[layer]
                if self.config.fail_from_block is not None and t.index >= self.config.fail_from_block:
                    kv[t.block_id].fill_(7.0)
                    self._failed.add(t.block_id)
                else:
                    kv[t.block_id].copy_(STORE[(layer, t.group, t.block_hash)])
            if self.config.load_async:
                self._loading.add(t.req_id)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: MemoryMetadata) -> None:
        for t in metadata.saves:
            if self._group_of[layer_name] == t.group:
                STORE[(layer_name, t.group, t.block_hash)] = kv_layer[t.block_id].clone()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str]]:
        done, self._loading = self._loading, set()
        return None, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed
