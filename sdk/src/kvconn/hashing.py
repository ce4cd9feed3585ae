"""Chained SHA-256 block hashes, shared by the prefix cache and the plugins.

Block ``i``'s hash covers its parent's hash, its token ids and any extra keys
(e.g. a LoRA or multimodal id), so it identifies the whole prefix up to and
including the block: two requests share block ``i``'s KV exactly when they
share its hash. Only full blocks are hashed.

The extra keys are vLLM's (:func:`block_extra_keys`): a request's adapter on
every block, since it changes every block's KV, and its ``cache_salt`` on the
first, which the chain carries to every later block. A connector that keys
blocks by these hashes keeps adapters apart (wrong KV otherwise) and tenants
apart (a salted prefix never serves another tenant), with no work of its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from .context import ConnectorContext

__all__ = ["ROOT_HASH", "block_extra_keys", "context_namespace", "hash_block", "hash_blocks", "namespace_key"]

#: The parent of a request's first block.
ROOT_HASH = hashlib.sha256(b"kvconn-root").digest()

_encode = msgspec.msgpack.Encoder().encode
_encode_sorted = msgspec.msgpack.Encoder(order="deterministic").encode


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()) -> bytes:
    """The hash of one full block whose parent block hashed to ``parent``."""
    return hashlib.sha256(_encode((parent, token_ids, extra_keys))).digest()


def block_extra_keys(index: int, *, adapter: str | None = None, cache_salt: str | None = None) -> tuple[object, ...]:
    """The extra keys of a request's block ``index``, as vLLM puts them in its block hashes.

    Derived from vLLM's ``generate_block_hash_extra_keys``
    (``vllm/v1/core/kv_cache_utils.py``): the LoRA adapter on every block
    (vLLM adds ``("lora", name, path)``; here the adapter's name), then the
    ``("cache_salt", salt)`` pair on block 0 only. Empty for a request with neither.
    """
    keys: list[object] = []
    if adapter is not None:
        keys.append(("lora", adapter))
    if cache_salt and index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys)


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes = ROOT_HASH,
    start: int = 0,
    extra_keys: tuple[object, ...] = (),
    adapter: str | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids[start:]`` (``start`` block-aligned).

    ``parent`` is the hash of the block before ``start``; pass the last known
    hash to extend a request's chain incrementally. Each block's extra keys
    are ``extra_keys`` and the request's :func:`block_extra_keys`.
    """
    hashes: list[bytes] = []
    end = len(token_ids) - (len(token_ids) - start) % block_size
    for pos in range(start, end, block_size):
        keys = extra_keys + block_extra_keys(pos // block_size, adapter=adapter, cache_salt=cache_salt)
        parent = hash_block(parent, token_ids[pos : pos + block_size], keys)
        hashes.append(parent)
    return hashes


def namespace_key(*parts: object) -> str:
    """A short, stable digest of what makes block bytes mean something.

    Connectors that share blocks between engines prefix their keys with it
    (model, dtype, layout, block size, TP rank, KV-cache group), so engines
    that differ in any of these never read each other's blocks.
    """
    return hashlib.sha256(_encode([str(p) for p in parts])).hexdigest()[:16]


def context_namespace(context: ConnectorContext, *parts: object) -> str:
    """The namespace of blocks written by engines like ``context``, refined by ``parts``.

    It covers every field of the context but ``engine_id`` (model, dtype, KV
    layout, block size, KV shape, tensor-parallel rank and size, the KV-cache
    groups with their layers and windows, and whatever the SDK adds there
    later): engines that differ in any of them never share a key, while two
    instances of the same engine do. ``parts`` add what the connector knows
    beyond the context (a key version, the group, a secret's public id).
    """
    fields = msgspec.structs.asdict(context)
    del fields["engine_id"]  # names one engine instance: engines alike share blocks
    # One msgpack document, not joined strings: ("a,b",) and ("a", "b") never encode alike.
    return namespace_key(_encode_sorted(fields).hex(), *parts)
