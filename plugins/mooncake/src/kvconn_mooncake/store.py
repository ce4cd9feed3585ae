"""Mooncake as a :class:`kvconn.store.BlockStore`, over the real client or the embedded store.

Both speak Mooncake's batch calls (``batch_is_exist``, ``batch_put_from``,
``batch_put_from_multi_buffers``, ``batch_get_into`` and
``batch_get_into_multi_buffers`` on host pointers, one int code per key); this maps them
onto the store contract: a code that means "no answer" (the master is
unreachable, a transfer failed) raises, so the connector degrades and its
guard probes the store; a full store refuses; a missing, evicted or
lease-expired value is missing. Keys are the SDK's bytes keys, hex-encoded
(Mooncake's keys are strings).

Stores are shared within a process: the scheduler's lookups must see what
the worker wrote, and a second Mooncake client would mount a second segment.
Embedded stores by name, for the life of the process; real clients by their
settings, reference-counted, closed once when the last store using one closes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from .codes import INVALID_PARAMS, LEASE_EXPIRED, NOT_FOUND, OK, STORE_FULL, TRANSFER_FAIL, code_name
from .config import RealStoreSettings
from .embedded import EmbeddedStore
from .mooncake_store import SharedClient, connect

__all__ = ["MooncakeBlockStore", "MooncakePartsStore", "StoreError", "open_real"]

T = TypeVar("T")
Caller = Callable[[Callable[[Any], T]], T]

_LOCK = threading.Lock()
_REAL: dict[RealStoreSettings, list[Any]] = {}  # settings -> [SharedClient, users]
_MISSING = (NOT_FOUND, LEASE_EXPIRED)  # a lease that expired mid-transfer leaves the buffer undefined: missing
_REFUSED = (STORE_FULL, INVALID_PARAMS)  # no room, or a value Mooncake cannot store (empty, too large)
_MISFIT = (INVALID_PARAMS, TRANSFER_FAIL)  # a multi-buffer get into parts smaller / larger than the value


class StoreError(ConnectionError):
    """Mooncake answered a code that says nothing about the key (the store cannot answer): the call raises."""


class MooncakeBlockStore:
    """A :class:`~kvconn.store.BlockStore` over Mooncake's batch calls.

    ``call(fn)`` runs ``fn(client)`` (the real client through its
    :class:`~kvconn_mooncake.mooncake_store.SharedClient`, or the embedded
    store); ``release`` runs once on :meth:`close`; ``register(ptr, size)``
    (rdma) is called once per buffer a transfer uses, which is then kept alive.
    """

    def __init__(
        self,
        call: Caller[Any],
        release: Callable[[], None] | None = None,
        register: Callable[[int, int], None] | None = None,
    ) -> None:
        #: ``call(fn)``: ``fn(client)`` on the Mooncake client (or embedded store) under this store
        self.call = call
        self._release = release
        self._register = register
        self._registered: dict[int, Any] = {}  # id of a buffer's owner -> the owner (kept alive: registered)

    @staticmethod
    def embedded(store: EmbeddedStore) -> MooncakePartsStore:
        return MooncakePartsStore(lambda fn: fn(store))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        names = [key.hex() for key in keys]
        codes = self.call(lambda client: client.batch_is_exist(names))
        return [_checked("batch_is_exist", code) == 1 for code in codes]

    def _batch(self, call: str, keys: Sequence[bytes], buffers: Sequence[bytes | memoryview]) -> tuple[list[str], Any]:
        """The key names, and the codes of Mooncake's ``call`` on one host buffer per key."""
        names = [key.hex() for key in keys]
        pinned = [_pinned(b) for b in buffers]
        ptrs, sizes = [p for p, _, _ in pinned], [n for _, n, _ in pinned]
        self._registering(pinned)
        return names, self.call(lambda client: getattr(client, call)(names, ptrs, sizes))

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        if not keys:
            return []
        _, codes = self._batch("batch_put_from", keys, values)
        return [code not in _REFUSED and _checked("batch_put_from", code) == OK for code in codes]

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        if not keys:
            return []
        names, codes = self._batch("batch_get_into", keys, buffers)
        lengths: list[int | None] = []
        for name, buffer, code in zip(names, buffers, codes, strict=True):
            if code in _MISSING:
                lengths.append(None)
            elif code == INVALID_PARAMS:  # the value is larger than the buffer: its length and what fits
                lengths.append(self._prefix(name, buffer))
            else:
                lengths.append(_checked("batch_get_into", code))
        return lengths

    def _prefix(self, name: str, buffer: memoryview) -> int | None:
        size = _checked("get_size", self.call(lambda client: client.get_size(name)), missing=NOT_FOUND)
        if size is None:
            return None
        whole = bytearray(size)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(whole))
        code = self.call(lambda client: client.batch_get_into([name], [ptr], [size]))[0]
        if code in _MISSING:
            return None
        n = min(_checked("batch_get_into", code), len(buffer))
        buffer[:n] = whole[:n]
        return size

    def _registering(self, pinned: Sequence[tuple[int, int, Any]]) -> None:
        if self._register is None:
            return
        for _, _, owner in pinned:
            if id(owner) not in self._registered:
                self._register(ctypes.addressof(ctypes.c_char.from_buffer(owner)), len(owner))
                self._registered[id(owner)] = owner

    def close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class MooncakePartsStore(MooncakeBlockStore):
    """A :class:`~kvconn.store.PartsStore` and :class:`~kvconn.store.ScatterStore` too.

    Saves read the KV caches in place, and async loads write them in place
    (memory that needs no registration). Over rdma the store is a plain
    :class:`MooncakeBlockStore` (staged): a transfer's memory must be
    registered first, and the KV caches are not this store's to register.
    """

    def get_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[int | None]:
        """As :meth:`get`, each value across its parts in order (``batch_get_into_multi_buffers``: no staging).

        Mooncake moves a value only into parts of exactly its size (smaller:
        ``INVALID_PARAMS``, larger: ``TRANSFER_FAIL``); for those codes the
        value's size is asked, and answered when it differs (the caller refuses
        that value); the same size means the transfer itself failed: raises.
        """
        if not keys:
            return []
        names = [key.hex() for key in keys]
        ptrs, sizes = self._pointers(parts, [])  # a get writes into its parts: none is read-only, none copied
        codes = self.call(lambda client: client.batch_get_into_multi_buffers(names, ptrs, sizes))
        lengths: list[int | None] = []
        for name, size, code in zip(names, sizes, codes, strict=True):
            if code in _MISSING:
                lengths.append(None)
            elif code in _MISFIT:
                stored = _checked("get_size", self.call(partial(_size, name)), missing=NOT_FOUND)
                if stored == sum(size):
                    raise StoreError(f"mooncake batch_get_into_multi_buffers failed: {code_name(code)} ({code})")
                lengths.append(stored)
            else:
                lengths.append(_checked("batch_get_into_multi_buffers", code))
        return lengths

    @staticmethod
    def _pointers(parts: Sequence[Sequence[memoryview]], keep: list[Any]) -> tuple[list[list[int]], list[list[int]]]:
        """Per value, the addresses and sizes of its parts; copies of read-only parts go to ``keep`` (hold it).

        On the path of every byte saved or loaded in place (a 64 MiB step has
        ~1,300 parts), so one flat comprehension per list, no tuple per part.
        """
        sizes = [[part.nbytes for part in value] for value in parts]
        address, buffer_of = ctypes.addressof, ctypes.c_char.from_buffer
        try:
            return [[address(buffer_of(part)) for part in value] for value in parts], sizes
        except (TypeError, ValueError):  # a read-only or empty part: the slow way
            return [[_address(part, keep) for part in value] for value in parts], sizes

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """As :meth:`put`, each value from its parts in order (``batch_put_from_multi_buffers``: no staging)."""
        if not keys:
            return []
        names = [key.hex() for key in keys]
        copies: list[Any] = []  # alive until the call returns
        ptrs, sizes = self._pointers(parts, copies)
        codes = self.call(lambda client: client.batch_put_from_multi_buffers(names, ptrs, sizes))
        return [code not in _REFUSED and _checked("batch_put_from_multi_buffers", code) == OK for code in codes]


def _size(name: str, client: Any) -> int:
    return int(client.get_size(name))


def _checked(call: str, code: int, missing: int | None = None) -> Any:
    """``code`` when it answers (``>= 0``; ``None`` for ``missing``); raises :class:`StoreError` otherwise."""
    if code >= 0:
        return code
    if code == missing:
        return None
    raise StoreError(f"mooncake {call} failed: {code_name(code)} ({code})")


def _address(view: memoryview, keep: list[Any]) -> int:
    """The address of ``view``'s bytes; read-only ones are copied first, the copy appended to ``keep``."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only (bytes), or empty
        copy = bytearray(view)
        keep.append(copy)
        return ctypes.addressof(ctypes.c_char.from_buffer(copy)) if copy else 0


def _pinned(view: bytes | memoryview) -> tuple[int, int, Any]:
    """The address and length of ``view``'s bytes, and the object owning them (kept alive by the caller)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view)), len(view), getattr(view, "obj", view)
    except (TypeError, ValueError):  # read-only (bytes): Mooncake only reads it, but ctypes wants writable memory
        copy = bytearray(view)
        return ctypes.addressof(ctypes.c_char.from_buffer(copy)) if copy else 0, len(copy), copy


def open_real(settings: RealStoreSettings, factory: Callable[[], Any], close_timeout_s: float) -> MooncakeBlockStore:
    """A store over the process's client for ``settings``, connecting it first if none is open."""
    with _LOCK:
        entry = _REAL.get(settings)
        if entry is None:
            entry = _REAL[settings] = [SharedClient(connect(settings, factory), close_timeout_s), 0]
        entry[1] += 1
        shared: SharedClient = entry[0]

    if settings.protocol == "rdma":
        return MooncakeBlockStore(shared.call, lambda: _release(settings), shared.register)
    return MooncakePartsStore(shared.call, lambda: _release(settings))


def _release(settings: RealStoreSettings) -> None:
    with _LOCK:
        entry = _REAL[settings]
        entry[1] -= 1
        if entry[1]:
            return
        del _REAL[settings]
    entry[0].close()
