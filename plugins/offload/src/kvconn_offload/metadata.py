"""What the scheduler side tells the worker side each step (plain data only)."""

from __future__ import annotations

import msgspec

from kvconn import BlockIds, KVConnectorMetadata

__all__ = ["BlockTransfer", "OffloadMetadata"]


class BlockTransfer(msgspec.Struct):
    """Copies between one request's device blocks and host sub-blocks.

    ``device_blocks[g][i]`` pairs with ``host_blocks[g][i]`` (sub-block index
    ``slot * block_size_multiple + j`` of the pool) for KV-cache group ``g``;
    the null block never appears. ``slots``/``keys`` are the offloaded blocks
    touched, so the worker can tag (store) or verify (load) what each slot
    holds. ``failed_blocks`` are device blocks of a load the scheduler already
    knows cannot be served (reported as load errors).
    """

    req_id: str
    device_blocks: list[list[int]]
    host_blocks: list[list[int]]
    slots: list[int] = msgspec.field(default_factory=list)
    keys: list[bytes] = msgspec.field(default_factory=list)
    failed_blocks: list[int] = msgspec.field(default_factory=list)


class OffloadMetadata(KVConnectorMetadata):
    """One step: at most one store job (``store_seq > 0``), the loads to start, and delayed frees.

    Store jobs are numbered in order; the worker reports the highest job
    number whose copies completed, which makes their blocks loadable. Sync
    loads (``load_async: false``) are numbered alike (``load_seq > 0``): they
    end in the step that runs them, and the worker's report of the highest
    number run unpins their slots (vLLM may build a step's metadata before the
    last step's report: the number says which loads a report covers).
    ``delayed_frees`` are finished requests whose blocks the scheduler keeps
    until the worker reports them in ``finished_sending``.
    """

    store_seq: int = 0
    stores: list[BlockTransfer] = msgspec.field(default_factory=list)
    loads: list[BlockTransfer] = msgspec.field(default_factory=list)
    load_seq: int = 0
    delayed_frees: list[str] = msgspec.field(default_factory=list)

    def block_ids_by_request(self) -> dict[str, BlockIds]:
        """The device blocks this step acts on, per request (conformance introspection)."""
        out: dict[str, list[list[int]]] = {}
        for transfer in (*self.stores, *self.loads):
            groups = out.setdefault(transfer.req_id, [[] for _ in transfer.device_blocks])
            for acc, ids in zip(groups, transfer.device_blocks, strict=True):
                acc.extend(ids)
        return {req_id: tuple(groups) for req_id, groups in out.items()}
