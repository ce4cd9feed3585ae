"""An in-process :class:`~kvconn.store.BlockStore` with fault injection, and its connector, for tests.

``MemoryStore(name)`` keeps values in a dict shared by every store of that
name in the process (so a scheduler side sees what its worker saved), with an
optional capacity (oldest values evicted first). :func:`faults` gives the
switches a test flips: ``down`` (every call raises ``ConnectionError``),
``stall`` (every call blocks until it is cleared), ``corrupt`` (values read
back with a flipped byte; ``damaged``: those of the keys it holds). ``MemoryStoreConnector`` is the store connector
over it: ``"kvconn.testing.memory_store:MemoryStoreConnector"``.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from ..store import BlockStore, StoreConfig, StoreConnector

__all__ = ["MemoryStore", "MemoryStoreConfig", "MemoryStoreConnector", "StoreFaults", "clear", "faults", "fresh_store"]


@dataclass
class StoreFaults:
    """What the stores of one name do wrong (all off by default)."""

    down: bool = False
    corrupt: bool = False
    #: keys whose values are read back damaged, as ``corrupt`` damages every value
    damaged: set[bytes] = field(default_factory=set)
    #: set: calls proceed; cleared: every call blocks until it is set again
    running: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.running.set()


_VALUES: dict[str, OrderedDict[bytes, bytes]] = {}
_FAULTS: dict[str, StoreFaults] = {}
_LOCK = threading.Lock()


def faults(name: str = "default") -> StoreFaults:
    """The fault switches of the stores called ``name``."""
    with _LOCK:
        return _FAULTS.setdefault(name, StoreFaults())


class MemoryStore:
    """A dict-backed :class:`~kvconn.store.BlockStore`, thread-safe, shared by name."""

    def __init__(self, name: str = "default", capacity: int | None = None) -> None:
        self.name = name
        self.capacity = capacity
        with _LOCK:
            self._values = _VALUES.setdefault(name, OrderedDict())
        self._faults = faults(name)

    def _enter(self) -> None:
        if not self._faults.running.is_set():  # is_set takes no lock: most calls never wait
            self._faults.running.wait()
        if self._faults.down:
            raise ConnectionError(f"memory store {self.name!r} is down (injected)")

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._enter()
        with _LOCK:
            return [key in self._values for key in keys]

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        self._enter()
        with _LOCK:
            for key, value in zip(keys, values, strict=True):
                if key not in self._values:
                    self._values[key] = bytes(value)
            while self.capacity is not None and len(self._values) > self.capacity:
                self._values.popitem(last=False)
            return [key in self._values for key in keys]

    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        self._enter()
        lengths: list[int | None] = []
        with _LOCK:
            for key, buffer in zip(keys, buffers, strict=True):
                value = self._values.get(key)
                if value is None:
                    lengths.append(None)
                    continue
                n = min(len(value), len(buffer))
                buffer[:n] = memoryview(value)[:n]  # a view: slicing the bytes would copy them first
                if (self._faults.corrupt or key in self._faults.damaged) and n:
                    buffer[n - 1] ^= 0xFF
                lengths.append(len(value))
        return lengths

    def close(self) -> None:
        """Nothing to release: the values live as long as the process."""


def clear() -> None:
    """Forget every memory store's values and faults."""
    with _LOCK:
        _VALUES.clear()
        _FAULTS.clear()


class MemoryStoreConfig(StoreConfig, kw_only=True):
    store: Annotated[str, msgspec.Meta(description="the memory store's name (stores of one name share values)")] = (
        "default"
    )


class MemoryStoreConnector(StoreConnector):
    """The store connector over :class:`MemoryStore`."""

    Config = MemoryStoreConfig
    in_process_state = True
    config: MemoryStoreConfig

    def open_store(self) -> BlockStore:
        return MemoryStore(self.config.store)


def fresh_store(run: str) -> dict[str, str]:
    """A ``config_factory`` (``kvconn validate --config-factory``): a memory store of its own for every run."""
    return {"store": f"{run}-{uuid.uuid4().hex}"}
