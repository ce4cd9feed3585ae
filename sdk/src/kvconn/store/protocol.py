"""``BlockStore``: the whole of what a store author writes.

A store keeps immutable byte values under byte keys. Four batched calls, no
capability flags; everything else a storage connector must get right (which
blocks, when, namespacing, integrity, deadlines, a store that is down) is
:class:`~kvconn.store.StoreConnector`'s. The calls are batched because every
step moves many blocks and a remote store pays per round trip.

The contract (docs/authoring.md gives it word for word: tests/test_docs.py
checks that the two agree; :class:`kvconn.testing.StoreConformance` checks a
store against it):

* Keys and values are bytes. Every call is batched: one answer per key, in
  the order asked (an empty batch answers an empty list).
* A value may disappear at any time (eviction, a restart): ``contains`` and
  ``get`` then say it is missing, never raise for it.
* ``put`` is write-once: a key that is stored keeps its first value.
* Calls may come from several threads at once. The scheduler and each worker
  open a store of their own, usually in other processes: they meet only
  through what the store holds, so a value ``put`` by one is seen by the
  others' ``contains`` and ``get`` once the ``put`` has returned.
* A store that cannot answer (down, unreachable, too slow for its own
  timeout) **raises** (any ``Exception``); it never answers "missing" for
  "don't know" and never hangs without bound. A full store is not that: it
  refuses the keys it cannot hold (``put`` answers ``False``).
* The connector puts a deadline on every call anyway (``timeout_s``); give
  the client a timeout of its own shorter than it, so that a call to a
  stalled server ends by raising rather than holding a store thread past the
  deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["BlockStore", "PartsStore", "ScatterStore"]


@runtime_checkable
class BlockStore(Protocol):
    """A batched key-value store of immutable byte values."""

    def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        """Per key, whether a value is stored under it now."""
        ...

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> Sequence[bool]:
        """Store ``values[i]`` under ``keys[i]`` unless the key holds a value already (write-once).

        A value may be a view of the caller's memory, valid only during the call: copy what you keep.

        Per key: ``True`` when the key holds a value afterwards (this one or
        the earlier one), ``False`` when the store refused it (full, too large).
        """
        ...

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Sequence[int | None]:
        """Copy the value of ``keys[i]`` into ``buffers[i]``.

        Per key: the value's length in bytes (the first ``min(length,
        len(buffers[i]))`` bytes are written), or ``None`` when the key holds
        nothing. The caller checks the length and the bytes.
        """
        ...

    def close(self) -> None:
        """Release connections; no call follows."""
        ...


@runtime_checkable
class PartsStore(BlockStore, Protocol):
    """A :class:`BlockStore` that also writes a value from several buffers (scatter-gather I/O).

    Optional. With it the connector saves host KV caches without staging:
    each value is the header, then the block's bytes in each layer, read in
    place. The parts are views of the caller's memory, valid only during the
    call; a call past its deadline may still read them while the engine
    changes them, which the integrity tag (taken before the call) catches on
    load.
    """

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> Sequence[bool]:
        """As :meth:`BlockStore.put`, the value of ``keys[i]`` being the concatenation of ``parts[i]``."""
        ...


@runtime_checkable
class ScatterStore(BlockStore, Protocol):
    """A :class:`BlockStore` that also reads a value into several buffers (scatter I/O).

    Optional. With it an async load of host KV caches skips staging: each
    value is read as its header into a buffer of the connector's and its
    payload straight into the block's row in each layer, and verified there
    before the request is reported loaded (a value that fails is reported
    failed and recomputed; a call past its deadline keeps the request
    waiting until it returns, so no late byte lands in a block the engine
    uses).
    """

    def get_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> Sequence[int | None]:
        """Read the value of ``keys[i]`` across ``parts[i]`` in order; keys are distinct.

        Per key: the value's length (``parts[i]`` hold it when it equals their
        total size, else their bytes are undefined), or ``None`` when the key
        holds nothing.
        """
        ...
