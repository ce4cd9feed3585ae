"""Store keys: a namespace for what the bytes mean, then the block's chained hash.

One key holds one block of one KV-cache group, *all of the group's layers*
(in the group's layer order). Per-layer keys would multiply the keys to check,
write and read by the number of layers; one key per block keeps every step to
one ``batch_is_exist``, one put and one get with as many keys as blocks, and
costs no copy (a value is gathered from, and scattered to, the per-layer
KV-cache tensors by the store's multi-buffer calls).

The namespace covers the model, dtype, KV layout, block size, tensor-parallel
rank and size, and the group (its index, layers and window): engines that
differ in any of them never read each other's blocks. The block hash chains
the whole prefix, so equal keys mean equal KV.
"""

from __future__ import annotations

from kvconn import ConnectorContext
from kvconn.hashing import namespace_key

__all__ = ["KEY_VERSION", "BlockKeys"]

#: Bumped when the value layout changes, so old values are never misread.
KEY_VERSION = "kvconn-mooncake-v1"


class BlockKeys:
    """Key maker for one engine's blocks."""

    def __init__(self, context: ConnectorContext) -> None:
        self.prefixes = [
            "kvconn/"
            + namespace_key(
                KEY_VERSION,
                context.model,
                context.dtype,
                context.kv_layout,
                context.block_size,
                context.tp_rank,
                context.tp_size,
                group,
                ",".join(spec.layer_names),
                spec.sliding_window,
            )
            + "/"
            for group, spec in enumerate(context.kv_cache_groups)
        ]

    def key(self, group: int, block_hash: bytes) -> str:
        return self.prefixes[group] + block_hash.hex()
