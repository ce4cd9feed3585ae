"""What the scheduler side sends the worker side each step (plain data)."""

from __future__ import annotations

import msgspec

from kvconn import KVConnectorMetadata

__all__ = ["BlockTransfer", "MooncakeMetadata"]


class BlockTransfer(msgspec.Struct, array_like=True, frozen=True):
    """One block of one KV-cache group, to save under or load from ``key``."""

    key: str
    block_id: int
    group: int


class MooncakeMetadata(KVConnectorMetadata):
    """This step's loads (before compute) and saves (after compute).

    ``finished_saves`` are finished requests whose blocks are held until the
    worker has run their saves (in ``saves``); it reports them as sent.
    """

    loads: list[BlockTransfer] = msgspec.field(default_factory=list)
    saves: list[BlockTransfer] = msgspec.field(default_factory=list)
    finished_saves: list[str] = msgspec.field(default_factory=list)
