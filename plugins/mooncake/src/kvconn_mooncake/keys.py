"""Store keys: a namespace for what the bytes mean, then the block's chained hash.

One key holds one block of one KV-cache group, *all of the group's layers*
(in the group's layer order). Per-layer keys would multiply the keys to check,
write and read by the number of layers; one key per block keeps every step to
one ``batch_is_exist``, one put and one get with as many keys as blocks, and
costs no copy (a value is gathered from the per-layer KV-cache tensors by the
store's multi-buffer calls).

The namespace is the SDK's one namespace,
:func:`kvconn.hashing.context_namespace`: every field of the
:class:`~kvconn.ConnectorContext` but ``engine_id`` (model, dtype, KV layout,
block size, KV shape, TP rank and size, the groups with their layer names and
windows, and whatever the SDK adds there later), refined by the key version,
the group's index, and an identifier of the integrity secret, all encoded as
one msgpack document, so engines that differ in any field never share a key.
The block hash chains the whole prefix, so equal keys mean equal KV.
What an engine leaves out of its context (its KV shape, say) is checked per
value as well: see :mod:`kvconn_mooncake.integrity`.
"""

from __future__ import annotations

from kvconn import ConnectorContext
from kvconn.hashing import context_namespace

__all__ = ["KEY_VERSION", "BlockKeys", "namespace"]

#: Bumped when the value layout changes, so old values are never misread (v3: the SDK's namespace).
KEY_VERSION = "kvconn-mooncake-v3"


def namespace(context: ConnectorContext, group: int, secret_id: str = "") -> str:
    """The hex digest naming group ``group``'s blocks of engines like ``context``."""
    return context_namespace(context, KEY_VERSION, group, secret_id)


class BlockKeys:
    """Key maker for one engine's blocks.

    ``secret_id`` names the integrity secret (see
    :func:`kvconn_mooncake.integrity.secret_id`): engines with different
    secrets cannot verify each other's values, so they do not share keys.
    """

    def __init__(self, context: ConnectorContext, secret_id: str = "") -> None:
        self.prefixes = [
            f"kvconn/{namespace(context, group, secret_id)}/" for group in range(len(context.kv_cache_groups))
        ]

    def key(self, group: int, block_hash: bytes) -> str:
        return self.prefixes[group] + block_hash.hex()
