"""Store keys: the one namespace of what a block's bytes mean, then the block's chained hash.

One key holds one block of one KV-cache group, all of the group's layers in
layer order: one key per block keeps a step to one batched call per
direction. The namespace is :func:`kvconn.hashing.context_namespace` of the
engine's context (every field but ``engine_id``, so the TP rank too), the key
version, the config's ``namespace``, the group and the integrity secret's
public id: engines that differ in any of them never read each other's values.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..context import ConnectorContext
from ..hashing import context_namespace

__all__ = ["KEY_VERSION", "BlockKeys"]

#: Bumped when the value layout changes, so old values are never read.
KEY_VERSION = "kvconn-store-v1"


class BlockKeys:
    """Key maker for one engine's (one TP rank's) blocks."""

    def __init__(self, context: ConnectorContext, namespace: str = "", secret_id: str = "") -> None:
        self.prefixes = [
            f"kvconn/{context_namespace(context, KEY_VERSION, namespace, group, secret_id)}/".encode()
            for group in range(len(context.kv_cache_groups))
        ]

    def key(self, group: int, block_hash: bytes) -> bytes:
        return self.prefixes[group] + block_hash

    def keys(self, group: int, block_hashes: Iterable[bytes]) -> list[bytes]:
        """:meth:`key` of each hash, in order (one call a batch)."""
        prefix = self.prefixes[group]
        return [prefix + block_hash for block_hash in block_hashes]
