"""A CPU stand-in for the worker of vLLM's ``OffloadingConnector``, plugged in where vLLM takes one: its spec.

vLLM 0.33's ``OffloadingConnector`` builds everything it runs from an
``OffloadingSpec`` that ``OffloadingSpecFactory`` resolves from
``kv_connector_extra_config`` (``spec_name``, and ``spec_module_path`` for a
spec outside vLLM). Its shipped ``CPUOffloadingSpec`` gives a scheduler-side
``CPUOffloadingManager`` (pure Python) and a worker-side ``CPUOffloadingWorker``
that copies through CUDA streams and events, so ``get_worker`` refuses a
machine without a GPU. vLLM's own unit tests of the connector swap in a spec
of their own through those two keys; :class:`CPUStandInOffloadingSpec` does
the same, keeping more of vLLM: it is ``CPUOffloadingSpec`` (its sizing, its
real ``CPUOffloadingManager``) with one change, the worker, which is
:class:`CPUCopyOffloadingWorker`. The connector, its scheduler and worker
halves (``OffloadingConnectorScheduler``, ``OffloadingConnectorWorker``, the
canonical KV views of ``register_kv_caches``) are vLLM's code, unchanged.

:class:`CPUCopyOffloadingWorker` makes the byte copies ``CPUOffloadingWorker``
makes (its direct layout: one page per block and layer, a CPU chunk holding
``blocks_per_chunk`` blocks, the first one skipped into by the GPU spec's
``block_indices``), with torch indexing on the CPU, so a wrong store or load
shows in the KV the model reads. Each copy is made when the job is submitted
and reported done at the next ``get_finished``: the real worker's stream waits
on the compute stream at submission, so it reads the same bytes; a race
between its copy and compute enqueued after it is not modelled.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

__all__ = ["CPUCopyOffloadingWorker", "CPUStandInOffloadingSpec"]


class CPUCopyOffloadingWorker(OffloadingWorker):
    """vLLM's CPU offloading worker's copies, made on the CPU (see the module docstring)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        self._blocks_per_chunk = blocks_per_chunk
        self._refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        #: per canonical tensor: the engine's blocks ``[num_blocks, page]`` and the store's, one row per block
        self._engine: list[torch.Tensor] = []
        self._store: list[torch.Tensor] = []
        for tensor in kv_caches.tensors:
            engine = tensor.tensor.view(torch.int8)
            self._engine.append(engine)
            self._store.append(torch.zeros((num_chunks * blocks_per_chunk, engine.shape[1]), dtype=torch.int8))
        self._done: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_store=False)

    def _copy(self, job_id: int, engine_spec: GPULoadStoreSpec, store_spec: LoadStoreSpec, *, to_store: bool) -> bool:
        """Copy every group's blocks between the engine's cache and the store's chunks, as vLLM's worker pairs them.

        Per group ``g``: ``engine_spec.group_sizes[g]`` engine blocks, and the chunks that hold them, the first
        entered ``block_indices[g] % blocks_per_chunk`` blocks in (``SingleDirectionOffloadingHandler``'s
        ``transfer_async`` and ``compute_sub_block_ptrs``); each layer's unpadded page is copied.
        """
        assert isinstance(store_spec, BlockIDsLoadStoreSpec), f"not a block-id spec: {store_spec!r}"
        per_chunk = self._blocks_per_chunk
        engine_ids, chunk_ids = engine_spec.block_ids.astype(np.int64), store_spec.block_ids.astype(np.int64)
        engine_at = chunk_at = 0
        num_bytes = 0
        for refs, size, first in zip(self._refs, engine_spec.group_sizes, engine_spec.block_indices, strict=True):
            if size == 0:
                continue
            skip = first % per_chunk
            chunks = chunk_ids[chunk_at : chunk_at + -(-(size + skip) // per_chunk)]
            rows = (chunks[:, None] * per_chunk + np.arange(per_chunk)).ravel()[skip : skip + size]
            blocks = engine_ids[engine_at : engine_at + size]
            engine_at, chunk_at = engine_at + size, chunk_at + len(chunks)
            store_rows, engine_rows = torch.from_numpy(rows), torch.from_numpy(blocks)
            for ref in refs:
                engine, store, page = self._engine[ref.tensor_idx], self._store[ref.tensor_idx], ref.page_size_bytes
                if to_store:
                    store[store_rows, :page] = engine[engine_rows, :page]
                else:
                    engine[engine_rows, :page] = store[store_rows, :page]
                num_bytes += size * page
        assert engine_at == len(engine_ids) and chunk_at == len(chunk_ids), "specs of unequal extent"
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=num_bytes, transfer_time=0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None  # every copy is made at submission

    def shutdown(self) -> None:
        self._engine.clear()
        self._store.clear()


class CPUStandInOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` whose worker is :class:`CPUCopyOffloadingWorker` (no CUDA needed)."""

    _stand_in: CPUCopyOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._stand_in is None:
            self._stand_in = CPUCopyOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._stand_in
