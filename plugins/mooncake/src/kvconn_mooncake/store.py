"""The ``Store`` protocol the connector codes against.

It is the subset of ``mooncake.store.MooncakeDistributedStore`` the connector
needs, shaped so that each call maps onto one Mooncake batch call:
a value is a list of *parts* (``ptrs[i]``, ``sizes[i]``), read or written in
order, so one key can hold a block of every layer of a KV-cache group straight
from (into) the KV-cache tensors, without a staging copy. One part per value
is Mooncake's ``batch_put_from`` / ``batch_get_into``; several parts are its
``*_multi_buffers`` variants. Return codes are Mooncake's (see
:mod:`kvconn_mooncake.codes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["Store"]


class Store(Protocol):
    """A key-value store of immutable byte values addressed by host pointers.

    Contract (both backends): a put of an existing key returns ``0`` and keeps
    the old value; values may disappear at any time (eviction, a restarted
    master); a failed call never raises, it returns negative codes.
    """

    def register_buffer(self, ptr: int, size: int) -> int:
        """Register memory that later puts read from and gets write into; ``0`` on success."""
        ...

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Per key: ``1`` present, ``0`` missing, negative on error."""
        ...

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Store key ``i`` as the concatenation of its parts; per key ``0`` or a negative code."""
        ...

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Copy value ``i`` into its parts, in order; per key the bytes read or a negative code."""
        ...

    def close(self) -> None:
        """Release the client. No other call may follow."""
        ...
