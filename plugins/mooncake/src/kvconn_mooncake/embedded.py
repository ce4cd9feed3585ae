"""The embedded store: an in-process stand-in with the real store's semantics.

It is the default backend, so the connector works with nothing started (``make
demo``), and the fast tier of the tests runs every behaviour without a master.
Semantics follow Mooncake's: puts are write-once (a put of an existing key
returns ``0`` and keeps the old value), capacity is bounded and the least
recently used values are evicted to make room, a value that cannot fit at all
fails with ``STORE_FULL``, a missing key reads as ``NOT_FOUND``, and a
destination smaller than the value is ``INVALID_PARAMS`` (a multi-buffer
destination larger than it, ``TRANSFER_FAIL``). A key named twice in one batch
get fails after its first copy (see ``batch_get_into``).

Values are copied from and to raw host pointers (``ctypes.memmove``), exactly
as Mooncake's ``batch_put_from`` / ``batch_get_into`` read and write host
memory, so :class:`~kvconn_mooncake.store.MooncakeBlockStore` drives both
backends alike. Callers must pass pointers to live host memory.

Stores are shared by name within a process (:func:`embedded_store`): the
scheduler-side connector checks what the worker-side one wrote.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Sequence

from .codes import INVALID_PARAMS, NOT_FOUND, OK, STORE_FULL, TRANSFER_FAIL

__all__ = ["EmbeddedStore", "embedded_store"]


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


class EmbeddedStore:
    """A bounded, LRU-evicting, write-once byte store (thread-safe)."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._values: OrderedDict[str, bytearray] = OrderedDict()
        #: each value's address, taken once when stored (a value is never resized, so it stays put)
        self._addresses: dict[str, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def health_check(self) -> int:
        return 0  # in-process: always reachable

    def get_size(self, key: str) -> int:
        with self._lock:
            value = self._values.get(key)
        return NOT_FOUND if value is None else len(value)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        with self._lock:
            return [int(key in self._values) for key in keys]

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self._put_each(keys, [[p] for p in ptrs], [[s] for s in sizes])

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Each value the concatenation of its parts."""
        return self._put_each(keys, ptrs, sizes)

    def _put_each(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        with self._lock:
            return [self._put(key, p, n) for key, p, n in zip(keys, ptrs, sizes, strict=True)]

    def _put(self, key: str, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
        """Store the value gathered from ``ptrs`` (one copy, straight into the value kept)."""
        if key in self._values:
            return OK  # write-once, like Mooncake's put
        total = sum(sizes)
        if total <= 0:
            return INVALID_PARAMS
        if total > self.capacity_bytes:
            return STORE_FULL
        while self.used_bytes + total > self.capacity_bytes:
            gone, evicted = self._values.popitem(last=False)
            del self._addresses[gone]
            self.used_bytes -= len(evicted)
            self.evictions += 1
        value = bytearray(total)
        offset = self._addresses[key] = _address(value)
        for ptr, size in zip(ptrs, sizes, strict=True):
            ctypes.memmove(offset, ptr, size)
            offset += size
        self._values[key] = value
        self.used_bytes += total
        return OK

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        # Mooncake fills only one destination of a key named twice in a batch, yet reports success
        # for each: never rely on it. Here every repeat fails, so a caller that does is caught.
        codes, seen = [], set()
        with self._lock:
            for key, p, s in zip(keys, ptrs, sizes, strict=True):
                codes.append(INVALID_PARAMS if key in seen else self._get(key, p, s))
                seen.add(key)
        return codes

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Each value across its parts in order, only into parts of exactly its size (as the real client).

        A repeated key fails, as in :meth:`batch_get_into`.
        """
        codes, seen = [], set()
        values, addresses, memmove = self._values, self._addresses, ctypes.memmove  # locals: per part, per page
        with self._lock:
            for key, p, n in zip(keys, ptrs, sizes, strict=True):
                value = None if key in seen else values.get(key)
                if value is None:
                    codes.append(INVALID_PARAMS if key in seen else NOT_FOUND)
                    continue
                seen.add(key)
                length, wanted = len(value), sum(n)
                if length != wanted:
                    codes.append(INVALID_PARAMS if length > wanted else TRANSFER_FAIL)
                    continue
                values.move_to_end(key)
                offset = addresses[key]
                for ptr, size in zip(p, n, strict=True):
                    memmove(ptr, offset, size)
                    offset += size
                codes.append(length)
        return codes

    def _get(self, key: str, ptr: int, size: int) -> int:
        value = self._values.get(key)
        if value is None:
            return NOT_FOUND
        if len(value) > size:
            return INVALID_PARAMS
        self._values.move_to_end(key)
        ctypes.memmove(ptr, self._addresses[key], len(value))
        return len(value)

    def close(self) -> None:
        """Nothing to release: the store lives as long as the process (see :func:`embedded_store`)."""


_STORES: dict[str, EmbeddedStore] = {}
_STORES_LOCK = threading.Lock()


def embedded_store(name: str, capacity_bytes: int) -> EmbeddedStore:
    """The process-wide embedded store called ``name``, created on first use.

    It outlives the connectors that use it, so one engine can load what an
    earlier one in the same process saved. Asking for an existing name with a
    different capacity is an error (the capacity would silently be ignored).
    """
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = EmbeddedStore(capacity_bytes)
        elif store.capacity_bytes != capacity_bytes:
            raise ValueError(
                f"embedded store {name!r} already exists with capacity {store.capacity_bytes} bytes, "
                f"not {capacity_bytes}: use another embedded_store name or the same capacity"
            )
        return store
