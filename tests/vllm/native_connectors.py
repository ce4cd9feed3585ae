"""vLLM connectors (``KVConnectorBase_V1`` subclasses) for the ``--vllm-connector`` tests: fixes and defects.

Imported by ``"native_connectors:Class"`` once the test puts this directory on ``sys.path``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import GPULoadStoreSpec


class ChunkedPrefillExampleConnector(ExampleConnector):
    """vLLM's ``ExampleConnector`` with the chunked-prefill save fixed (vLLM issue 16928, fix PR 53314).

    ``ExampleConnector`` records a prompt for saving only on its first step, with the blocks of that step's
    chunk, yet claims the whole prompt on a later hit: repeating a prompt prefilled in chunks makes the
    worker load fewer tokens than the slots it planned (a shape mismatch). Here a prompt whose first
    chunk does not cover its full blocks is saved on the step its last full block is computed, with the
    request's whole table from vLLM's block state.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._unsaved: dict[str, list[int]] = {}  # requests whose save waits for their last full block

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, ExampleConnectorMetadata)
        partial = [r for r in meta.requests if r.is_store and len(r.slot_mapping) < len(r.token_ids)]
        meta.requests = [r for r in meta.requests if not any(r is p for p in partial)]
        waiting = {tuple(r.token_ids.tolist()) for r in partial}
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            if tuple(prompt[: align_to_block_size(len(prompt), self._block_size)]) in waiting:
                self._unsaved[new.req_id] = prompt
        for req_id in scheduler_output.finished_req_ids:
            self._unsaved.pop(req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        state = scheduler_output.kv_connector_block_state
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._unsaved.get(req_id)
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            if prompt is None or done < align_to_block_size(len(prompt), self._block_size):
                continue
            del self._unsaved[req_id]
            meta.add_request(
                token_ids=prompt,
                block_ids=state.get_block_ids(req_id)[0],
                block_size=self._block_size,
                is_store=True,
                mm_hashes=[],
            )
        return meta


class BlockStateInMetadataConnector(ChunkedPrefillExampleConnector):
    """A defect: keeps vLLM's block state in its metadata (to resolve tables on the worker)."""

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        meta.block_state = scheduler_output.kv_connector_block_state  # type: ignore[attr-defined]
        return meta


class OffByOneBlockLoadsConnector(ChunkedPrefillExampleConnector):
    """A defect: loads each block of a hit into the block whose id follows (an off-by-one block id)."""

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        for request in meta.requests:
            if not request.is_store:
                request.slot_mapping = request.slot_mapping + self._block_size
        return meta


class SkipsLoadsConnector(ChunkedPrefillExampleConnector):
    """A defect: claims its hits but its worker loads nothing (the request computes on whatever its blocks hold)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None


class FailedLoadAwareOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` that stops claiming a request's hit once a load into its blocks failed.

    vLLM 0.33's ``OffloadingConnector`` has no failed-load path (vLLM issue 39732): its worker asserts that
    every transfer succeeded (``OffloadingConnectorWorker.get_finished``), and its scheduler side ignores
    ``invalid_block_ids`` and ``failed_recving``, so when vLLM reports a failed load and asks again
    (``Scheduler._update_waiting_for_remote_kv``), it claims the same blocks, which fail again. Here a
    request whose loaded blocks came back in ``invalid_block_ids``, or that came back in ``failed_recving``
    (several KV-cache groups), is offered nothing more: vLLM recomputes it.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._loading: dict[str, set[int]] = {}  # request -> the blocks of its load in flight
        self._failed: set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (0, False) if request.request_id in self._failed and tokens else (tokens, load_async)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens:
            self._loading[request.request_id] = {b for group in blocks.get_block_ids() for b in group}

    def update_connector_output(self, connector_output: Any) -> None:
        failed = set(connector_output.invalid_block_ids or ())
        self._failed |= {req_id for req_id, blocks in self._loading.items() if blocks & failed}
        self._failed |= set(connector_output.failed_recving or ())  # several KV-cache groups: per request
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)
        super().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def _forget(self, req_id: str) -> None:
        self._loading.pop(req_id, None)
        self._failed.discard(req_id)


class RotatedLoadsOffloadingConnector(FailedLoadAwareOffloadingConnector):
    """A defect: each load lands in the request's blocks rotated by one (the right blocks, the wrong positions)."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        for job in meta.load_jobs.values():
            spec = job.dst_spec
            job.dst_spec = GPULoadStoreSpec(list(np.roll(spec.block_ids, 1)), spec.group_sizes, spec.block_indices)
        return meta


#: (store, block hash) -> {layer: one block of that layer}: what HashedBlocksConnector saved, in this process.
HASHED_STORE: dict[tuple[str, int, bytes], dict[str, Any]] = {}


class HashedBlocksMetadata(KVConnectorMetadata):
    """Pairs of (block hash, block id) to save and to load: no request id anywhere."""

    def __init__(self, saves: list[tuple[bytes, int]], loads: list[tuple[bytes, int]]) -> None:
        self.saves, self.loads = saves, loads


class HashedBlocksConnector(KVConnectorBase_V1):
    """A correct vLLM connector whose metadata names no request: (block hash, block id) pairs.

    Scheduler side: claims the blocks of a prompt whose every layer is in :data:`HASHED_STORE`
    (never a block whose load failed, never the last prompt token), and saves each block on the step
    that fills it, with the live table from vLLM's block state, for every scheduled request.
    Worker side: copies blocks between the KV caches and the store, saves landing at ``wait_for_save``.
    ``kv_connector_extra_config``: ``store``, the store's name.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.store = str(self._kv_transfer_config.get_from_extra_config("store", "default"))
        # each tensor-parallel rank holds its own shard of a block: vLLM sets a worker's rank in its parallel config
        self.rank, self.ranks = vllm_config.parallel_config.rank, vllm_config.parallel_config.tensor_parallel_size
        self.requests: dict[str, Any] = {}
        self.saved_upto: dict[str, int] = {}
        self.pending_loads: list[tuple[bytes, int]] = []
        self.loads_in_flight: dict[int, bytes] = {}
        self.failed_hashes: set[bytes] = set()
        self.kv_caches: dict[str, Any] = {}
        self.errors: set[int] = set()
        self.unsaved: dict[bytes, dict[str, Any]] = {}

    def key(self, block_hash: bytes, rank: int | None = None) -> tuple[str, int, bytes]:
        """Where this worker's shard of a block lives (``rank``: another rank's), in :data:`HASHED_STORE`."""
        return self.store, self.rank if rank is None else rank, block_hash

    def held(self, block_hash: bytes) -> bool:
        """Whether every rank's shard of the block is in the store (the scheduler answers for all ranks)."""
        return all(self.key(block_hash, rank) in HASHED_STORE for rank in range(self.ranks))

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        bs, hits = self.block_size, 0
        for block_hash in request.block_hashes[num_computed_tokens // bs : (request.num_tokens - 1) // bs]:
            if block_hash in self.failed_hashes or not self.held(block_hash):
                break
            hits += 1
        return hits * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        table = blocks.get_block_ids()[0]
        loads = [(request.block_hashes[i], table[i]) for i in range(first, last)]
        self.pending_loads += loads
        self.loads_in_flight.update({block_id: block_hash for block_hash, block_id in loads})
        self.requests[request.request_id] = request
        self.saved_upto[request.request_id] = last

    def acting(self, scheduler_output: Any) -> list[str]:
        """The requests whose blocks may fill this step: every scheduled one."""
        return list(scheduler_output.num_scheduled_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self.pending_loads = HashedBlocksMetadata([], self.pending_loads), []
        for req_id in self.acting(scheduler_output):
            request = self.requests.get(req_id)
            if request is None:
                continue
            computed = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            full = min(computed // self.block_size, len(request.block_hashes))
            start = self.saved_upto[req_id]
            if full <= start:
                continue
            table = self.table(scheduler_output, req_id)
            meta.saves += [(request.block_hashes[i], table[i]) for i in range(start, full)]
            self.saved_upto[req_id] = full
        return meta

    def table(self, scheduler_output: Any, req_id: str) -> list[int]:
        """The request's live table (its first KV-cache group), from vLLM's block state."""
        return list(scheduler_output.kv_connector_block_state.get_block_ids(req_id)[0])

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = connector_output.invalid_block_ids or set()
        self.failed_hashes.update(h for b, h in self.loads_in_flight.items() if b in invalid)
        self.loads_in_flight = {}  # sync loads: done with the step that carried them

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self.requests.pop(request.request_id, None)
        self.saved_upto.pop(request.request_id, None)
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HashedBlocksMetadata)
        for block_hash, block_id in meta.loads:
            saved = HASHED_STORE.get(self.key(block_hash))
            if saved is None:
                self.errors.add(block_id)
                continue
            for layer, kv in self.kv_caches.items():
                kv[block_id].copy_(saved[layer])

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HashedBlocksMetadata)
        for block_hash, block_id in meta.saves:
            self.unsaved.setdefault(block_hash, {})[layer_name] = kv_layer[block_id].clone()

    def wait_for_save(self) -> None:
        for block_hash, layers in self.unsaved.items():
            HASHED_STORE.setdefault(self.key(block_hash), layers)
        self.unsaved = {}

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors


class NewBlocksOnlyHashedConnector(HashedBlocksConnector):
    """The seed's bug, natively: it saves only for requests that got new blocks this step, so the step that fills
    a block and allocates none saves nothing. Its metadata names no request, so only what lands shows it."""

    def acting(self, scheduler_output: Any) -> list[str]:
        cached = scheduler_output.scheduled_cached_reqs
        grown = [r for r, ids in zip(cached.req_ids, cached.new_block_ids, strict=True) if ids is not None]
        return [r.req_id for r in scheduler_output.scheduled_new_reqs] + grown


class ClaimsWholePromptConnector(HashedBlocksConnector):
    """Claims every full block of a prompt it holds, the last included: a block-aligned prompt leaves vLLM's
    scheduler no token to compute after the synchronous load (``assert num_new_tokens > 0``)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        bs, hits = self.block_size, 0
        for block_hash in request.block_hashes[num_computed_tokens // bs :]:
            if not self.held(block_hash):
                break
            hits += 1
        return hits * bs, False


class RankBlindHashedConnector(HashedBlocksConnector):
    """Keys a block by its hash alone: the tensor-parallel ranks' shards of a block land under one key."""

    def key(self, block_hash: bytes, rank: int | None = None) -> tuple[str, int, bytes]:
        return self.store, 0, block_hash


class ClaimsPromptOnResumeConnector(HashedBlocksConnector):
    """Claims the whole prompt of a request it saw before (resumed after preemption), sure that a preempted request
    had computed, and saved, its prompt: true of a decode, not of a request preempted mid-prefill, whose later
    blocks it never held. With a block-aligned prompt vLLM's scheduler is then left no token to compute."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self.requests:  # scheduled before: resumed after preemption
            return len(request.prompt_token_ids) // self.block_size * self.block_size - num_computed_tokens, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class AppendsAfterPreemptionConnector(HashedBlocksConnector):
    """Keeps each request's table from its first step and appends what later steps add, a resumed request's
    table included (a request tracker that outlives preemption): after a resume it saves other blocks' bytes."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.tables: dict[str, list[int]] = {}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:  # under the V2 runner a resumed request comes back here
            self.tables.setdefault(new.req_id, []).extend(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, added in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if added is not None:  # under V1, a resumed request's whole new table: appended all the same
                self.tables.setdefault(req_id, []).extend(added[0])
        return super().build_connector_meta(scheduler_output)

    def table(self, scheduler_output: Any, req_id: str) -> list[int]:
        return self.tables[req_id]

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self.tables.pop(request.request_id, None)
        return super().request_finished(request, block_ids)


class AllGroupsDelegatingConnector(HashedBlocksConnector, SupportsHMA):
    """``request_finished_all_groups`` calls its own ``request_finished`` (as LMCache's does): vLLM calls one."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids)


#: The server of :class:`RequestIdServerConnector`: the request ids it finished, shared by every instance in this
#: process (it outlives runs and validate invocations, as LMCache's multi-process server does).
SERVER_FINISHED: set[str] = set()


class RequestIdServerConnector(HashedBlocksConnector):
    """Keeps each request's state on a server, under its request id (LMCache's multi-process connector): an id the
    server already finished would be served that request's state, so it is refused loudly (a real vLLM never
    repeats an id)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in SERVER_FINISHED:
            raise RuntimeError(
                f"the server already finished a request with id {request.request_id!r}: it would serve that "
                "request's state to this one (request ids must never repeat)"
            )
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        SERVER_FINISHED.add(request.request_id)
        return super().request_finished(request, block_ids)
