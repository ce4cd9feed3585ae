"""Faults injected into a store connector's store, for the checks: a store that hangs, one that is down.

The connector under test is run as a subclass whose ``open_store`` wraps the
store it opens (:func:`faulty_class`), so the SDK's guard, keys and integrity
are the connector's own, and only the store's answers change.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvconn.store import BlockStore, StoreConnector

__all__ = ["FaultyStore", "faulty_class"]


class FaultyStore:
    """A plain :class:`~kvconn.store.BlockStore` over ``inner`` that answers, hangs or raises as told."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.mode = "ok"  # "ok", "hang" (until released, at most 60 s) or "down" (raises ConnectionError)
        self.released = threading.Event()

    def _fault(self) -> None:
        if self.mode == "hang":
            self.released.wait(60.0)
        elif self.mode == "down":
            raise ConnectionError("injected: the store is down")

    def contains(self, keys: Sequence[bytes]) -> Sequence[bool]:
        self._fault()
        return self.inner.contains(keys)

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> Sequence[bool]:
        self._fault()
        return self.inner.put(keys, values)

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> Sequence[int | None]:
        self._fault()
        return self.inner.get(keys, buffers)

    def close(self) -> None:
        self.released.set()
        self.inner.close()


def faulty_class(cls: type[StoreConnector], stores: list[FaultyStore]) -> type[StoreConnector]:
    """``cls`` whose stores are :class:`FaultyStore`-s, each appended to ``stores`` as it opens."""

    def open_store(self: Any) -> BlockStore:
        store = FaultyStore(cls.open_store(self))
        stores.append(store)
        return store

    return type(f"Faulty{cls.__name__}", (cls,), {"open_store": open_store, "inline_calls": False})
