"""Store keys: a namespace for what the bytes mean, then the block's chained hash.

One key holds one block of one KV-cache group, *all of the group's layers*
(in the group's layer order). Per-layer keys would multiply the keys to check,
write and read by the number of layers; one key per block keeps every step to
one ``batch_is_exist``, one put and one get with as many keys as blocks, and
costs no copy (a value is gathered from the per-layer KV-cache tensors by the
store's multi-buffer calls).

The namespace is the SHA-256 of one msgpack tuple: the key version, every
field of the :class:`~kvconn.ConnectorContext` but ``engine_id`` (model,
dtype, KV layout, block size, KV shape, TP rank and size, the groups with
their layer names and windows, and whatever the SDK adds there later), the
group's index, and an identifier of the integrity secret. A tuple cannot be
shifted into another (``("a,b",)`` and ``("a", "b")`` encode differently,
unlike a joined string), so engines that differ in any field never share a
key. The block hash chains the whole prefix, so equal keys mean equal KV.
What an engine leaves out of its context (its KV shape, say) is checked per
value as well: see :mod:`kvconn_mooncake.integrity`.
"""

from __future__ import annotations

import hashlib

import msgspec

from kvconn import ConnectorContext

__all__ = ["KEY_VERSION", "BlockKeys", "namespace"]

#: Bumped when the value layout changes, so old values are never misread.
KEY_VERSION = "kvconn-mooncake-v2"

_ENCODE = msgspec.msgpack.Encoder(order="deterministic").encode


def namespace(context: ConnectorContext, group: int, secret_id: str = "") -> str:
    """The hex SHA-256 naming group ``group``'s blocks of engines like ``context``."""
    fields = msgspec.structs.asdict(context)
    del fields["engine_id"]  # names one engine instance: engines alike share blocks
    return hashlib.sha256(_ENCODE((KEY_VERSION, fields, group, secret_id))).hexdigest()


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
