"""vLLM connectors (``KVConnectorBase_V1`` subclasses) for the ``--vllm-connector`` tests: fixes and defects.

Imported by ``"native_connectors:Class"`` once the test puts this directory on ``sys.path``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
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
