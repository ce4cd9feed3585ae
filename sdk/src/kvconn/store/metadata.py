"""What a store connector's scheduler side sends its workers each step (plain data)."""

from __future__ import annotations

import msgspec

from ..block_state import BlockIds
from ..metadata import KVConnectorMetadata

__all__ = ["StoreBlock", "StoreMetadata"]


class StoreBlock(msgspec.Struct, array_like=True, frozen=True):
    """One block of one KV-cache group of a request: its slot in the KV cache and its chained hash.

    Workers build the key from the hash in their own namespace (each
    tensor-parallel rank stores its shard apart).
    """

    req_id: str
    group: int
    block_id: int
    block_hash: bytes


class StoreMetadata(KVConnectorMetadata):
    """This step's loads (before compute) and saves (after compute).

    ``finished_saves``: finished requests whose blocks are held until this
    step's saves have landed; the worker reports them in ``finished_sending``.
    """

    loads: list[StoreBlock] = msgspec.field(default_factory=list)
    saves: list[StoreBlock] = msgspec.field(default_factory=list)
    finished_saves: list[str] = msgspec.field(default_factory=list)
    load_async: bool = True

    def block_ids_by_request(self) -> dict[str, BlockIds]:
        """The device blocks this step acts on, per request (conformance introspection)."""
        groups = 1 + max((b.group for b in (*self.loads, *self.saves)), default=0)
        out: dict[str, list[list[int]]] = {}
        for block in (*self.loads, *self.saves):
            out.setdefault(block.req_id, [[] for _ in range(groups)])[block.group].append(block.block_id)
        return {req_id: tuple(ids) for req_id, ids in out.items()}
