"""``HookReferenceConnector``: a connector written on the raw hooks, the suite's hook-level reference.

A correct in-process saving and loading connector written on the raw hooks
(no :mod:`kvconn.store`), loaded as
``"kvconn.testing.raw_hook_connector:HookReferenceConnector"``. It is the base the
suite's deliberately broken connectors change one hook in, and that tests of
the host against a connector misbehaving in one hook subclass: its hooks are
its own methods, so overriding one changes exactly that hook. The connector
for engine and fault tests is :class:`kvconn.testing.memory_connector.MemoryConnector`
(a store connector).

Scheduler side: saves every full block on the step that fills it, reading the
live table from the block state; reports prefix hits (the blocks whose every
layer is in the store, up to the first whose async load failed before: a
corrupt value stays in the store, and an engine asks again after a failed
async load; with several KV-cache groups, up to the first whose load failed,
as vLLM then asks again after any); loads sync or async (``load_async``).
Worker side:
copies blocks to and from :data:`STORE`, a dict shared by every instance in
the process, keyed by a namespace of the engine's model, dtype, block size
and KV-cache groups (and ``store``), its tensor-parallel rank, the layer and the block hash; a block
missing from the store when it is loaded is reported in
``get_block_ids_with_load_errors``.

Fault injection for recovery tests: ``fail_from_block`` makes the worker write
garbage into the loaded blocks from that index of each load on, and report
them failed; ``fail_hook`` makes the named hook raise.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from .. import (
    BlockIds,
    ConnectorRequest,
    FilledBlocks,
    KVConnector,
    KVConnectorBlockState,
    KVConnectorMetadata,
    KVConnectorOutput,
    SchedulerOutput,
    filled_blocks,
    iter_block_ids,
)
from ..hashing import namespace_key
from ..hookspecs import HOOK_NAMES

__all__ = [
    "STORE",
    "HookReferenceConfig",
    "HookReferenceConnector",
    "HookReferenceMetadata",
    "Transfer",
    "fresh_namespace",
]

#: (namespace, layer, block hash) -> one block of one layer, shared by every instance.
STORE: dict[tuple[str, str, bytes], Any] = {}
#: What a load injected to fail writes into its blocks: far outside the reference model's KV range.
_GARBAGE = 7.0


class HookReferenceConfig(msgspec.Struct, forbid_unknown_fields=True):
    #: A namespace of its own within the engine's, so that test runs never share blocks.
    store: str = "default"
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
    group: int
    block_id: int
    block_hash: bytes
    index: int = 0  # position of the block in its transfer (for a load: in the loaded range)


class HookReferenceMetadata(KVConnectorMetadata):
    saves: list[Transfer] = msgspec.field(default_factory=list)
    loads: list[Transfer] = msgspec.field(default_factory=list)


class HookReferenceConnector(KVConnector):
    Config = HookReferenceConfig
    Metadata = HookReferenceMetadata
    saves = loads = True
    api_version = "1.0"
    #: STORE is this process's memory: its sides must run in one process
    in_process_state = True
    config: HookReferenceConfig

    def __init__(self, config: HookReferenceConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        ctx = self.context
        self.namespace = namespace_key(
            self.config.store, ctx.model, ctx.dtype, ctx.block_size, ctx.kv_cache_groups, ctx.tp_rank
        )
        self.requests: dict[str, ConnectorRequest] = {}
        self.saved_upto: dict[str, int] = {}  # blocks of each request already saved or loaded
        self.pending_loads: list[Transfer] = []
        #: remembered loads in flight, per request: block id -> block hash; hashes whose load failed
        self.loads_in_flight: dict[str, dict[int, bytes]] = {}
        self.sent_sync: set[str] = set()  # sync loads whose metadata went out: reported on the next update
        self.failed_hashes: set[bytes] = set()
        self.kv_caches: dict[str, Any] = {}
        self.failed: set[int] = set()
        self.loading: set[str] = set()  # worker side: async loads done this step
        self.layers = [layer for group in ctx.kv_cache_groups for layer in group.layer_names]
        if self.config.fail_hook:
            setattr(self, self.config.fail_hook, self._injected_failure)

    def _injected_failure(self) -> None:
        raise RuntimeError(f"injected failure in {self.config.fail_hook}")

    @property
    def remembers_failures(self) -> bool:
        """Whether a failed load is remembered: where the engine asks again after it (see the module docstring)."""
        return self.config.load_async or len(self.context.kv_cache_groups) > 1

    def _saved(self, block_hash: bytes) -> bool:
        return all((self.namespace, layer, block_hash) in STORE for layer in self.layers)

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.context.block_size
        hits = 0
        for block_hash in self.block_keys(request)[num_computed_tokens // bs :]:
            if block_hash in self.failed_hashes or not self._saved(block_hash):
                break
            hits += 1
        return hits * bs, self.config.load_async

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        bs = self.context.block_size
        first = request.num_computed_tokens // bs
        last = first + num_external_tokens // bs
        self.requests[request.request_id] = request
        self.saved_upto[request.request_id] = last
        loads = self.transfers(request, block_ids, range(first, last))
        self.pending_loads += loads
        if loads and self.remembers_failures:
            self.loads_in_flight[request.request_id] = {t.block_id: t.block_hash for t in loads}

    def transfers(self, request: ConnectorRequest, block_ids: BlockIds, blocks: range) -> list[Transfer]:
        ids, keys = iter_block_ids(block_ids, blocks.start, blocks.stop), self.block_keys(request)
        return [Transfer(request.request_id, g, b, keys[i], i - blocks.start) for i, g, b in ids]

    def block_keys(self, request: ConnectorRequest) -> Sequence[bytes]:
        """What each block of ``request`` is stored under: the engine's block hashes (the seam broken keys override)."""
        return request.block_hashes

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> HookReferenceMetadata:
        meta = HookReferenceMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if not self.config.load_async and self.remembers_failures:
            self.sent_sync.update(t.req_id for t in meta.loads)
        for filled in filled_blocks(scheduler_output, self.context.block_size):
            req_id = filled.req_id
            request = self.requests.get(req_id)
            if request is None:
                continue
            full = self.blocks_to_save(request, filled)
            start = self.saved_upto[req_id]
            if full <= start:
                continue
            table = block_state.get_block_ids(req_id)
            if table is None:
                continue  # not offered this step: save it on a later one
            meta.saves += self.transfers(request, table, range(start, full))
            self.saved_upto[req_id] = full
        return meta

    def blocks_to_save(self, request: ConnectorRequest, filled: FilledBlocks) -> int:
        """How many of the request's first blocks are full, and hashed, once this step's tokens are computed."""
        return min(filled.end, len(request.block_hashes))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Remember the blocks whose load failed (never claimed again); forget the loads that ended.

        A failed sync load costs the request a recompute (with one KV-cache
        group); a failed async load with no valid prefix sends it back to be
        asked again (so does any failed load under vLLM with several groups),
        and claiming the same bad block then would loop for ever.
        """
        invalid, done = connector_output.invalid_block_ids, connector_output.finished_recving
        failed = connector_output.failed  # the worker side raised: every load in flight failed
        done = done | self.sent_sync  # a sync load ends with the step its metadata went in
        self.sent_sync = set()
        for req_id, hashes in list(self.loads_in_flight.items()):
            self.failed_hashes.update(h for b, h in hashes.items() if failed or b in invalid)
            if failed or req_id in done:
                del self.loads_in_flight[req_id]

    def request_finished(self, request: ConnectorRequest) -> bool:
        self.requests.pop(request.request_id, None)
        self.saved_upto.pop(request.request_id, None)
        return False

    def get_num_tracked_requests(self) -> int:
        return len(self.requests) + len(self.loading)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    def layers_of(self, group: int) -> tuple[str, ...]:
        return self.context.kv_cache_groups[group].layer_names

    def start_load_kv(self, metadata: HookReferenceMetadata) -> None:
        fail_from = self.config.fail_from_block
        for t in metadata.loads:
            for layer in self.layers_of(t.group):
                saved = STORE.get((self.namespace, layer, t.block_hash))
                if fail_from is not None and t.index >= fail_from:
                    self.kv_caches[layer][t.block_id].fill_(_GARBAGE)
                    self.failed.add(t.block_id)
                elif saved is None:
                    self.failed.add(t.block_id)
                else:
                    self.load_block(layer, t.block_id, saved)
            if self.config.load_async:
                self.loading.add(t.req_id)

    def load_block(self, layer: str, block_id: int, saved: Any) -> None:
        """Write a block's saved bytes of ``layer`` into ``block_id``: a copy (the seam broken loaders override)."""
        self.kv_caches[layer][block_id].copy_(saved)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str]]:
        done, self.loading = self.loading, set()
        return None, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: HookReferenceMetadata) -> None:
        for t in metadata.saves:
            if layer_name in self.layers_of(t.group):
                STORE[(self.namespace, layer_name, t.block_hash)] = kv_layer[t.block_id].clone()


def fresh_namespace(run: str) -> dict[str, str]:
    """A ``config_factory`` (``kvconn validate --config-factory``): a store namespace of its own for every run."""
    return {"store": f"{run}-{uuid.uuid4().hex}"}
