"""Choosing a backend from the config, and sharing it within a process.

An engine runs a scheduler-side and a worker-side connector; when they share
a process they must share the store: the scheduler's lookups must see what the
worker wrote, and a second Mooncake client would mount a second segment. So
stores are shared per process: embedded ones by name, for the life of the
process; real ones by their settings, reference-counted, and closed exactly
once when the last connector using one shuts down.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvconn import ConnectorConfigError, ConnectorContext, ConnectorLoadError

from .config import MooncakeConfig, RealStoreSettings, resolve_backend
from .embedded import embedded_store
from .integrity import secret_id
from .keys import BlockKeys
from .mooncake_store import MooncakeStore
from .store import Store

__all__ = ["StoreLease", "StoreSide", "acquire_store"]

_LOCK = threading.Lock()
_REAL: dict[RealStoreSettings, list[Any]] = {}  # settings -> [store, users]


class StoreLease:
    """One connector's use of a shared store; :meth:`release` once when done."""

    def __init__(self, store: Store, backend: str, release: Callable[[], None] | None = None) -> None:
        self.store = store
        self.backend = backend
        self._release = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def acquire_store(config: MooncakeConfig, client_factory: Callable[[], Any] | None = None) -> StoreLease:
    """The store ``config`` selects, shared with the other connectors of this process."""
    settings = resolve_backend(config)
    if settings is None:
        try:
            store = embedded_store(config.embedded_store, config.embedded_capacity_bytes)
        except ValueError as exc:
            raise ConnectorConfigError(
                f"invalid config for connector 'mooncake': field 'embedded_capacity_bytes': {exc}"
            ) from None
        return StoreLease(store, "embedded")
    with _LOCK:
        entry = _REAL.get(settings)
        if entry is None:
            try:
                entry = _REAL[settings] = [MooncakeStore(settings, client_factory), 0]
            except ImportError as exc:
                raise ConnectorLoadError(f"connector 'mooncake': {exc}") from exc
        entry[1] += 1
    return StoreLease(entry[0], "mooncake", lambda: _release_real(settings))


def _release_real(settings: RealStoreSettings) -> None:
    with _LOCK:
        entry = _REAL[settings]
        entry[1] -= 1
        if entry[1] == 0:
            del _REAL[settings]
            entry[0].close()


class StoreSide:
    """What both sides of ``mooncake`` share: a lease on the store ``config`` selects, and the block keys.

    ``lease``: a store to use instead (tests); it is released on shutdown all the same.
    """

    def __init__(self, config: MooncakeConfig, context: ConnectorContext, lease: StoreLease | None = None) -> None:
        self._lease = lease if lease is not None else acquire_store(config)
        #: ``"embedded"`` or ``"mooncake"`` (the real store)
        self.backend = self._lease.backend
        self.store = self._lease.store
        #: this side's key namespace (per group, TP rank and secret)
        self.keys = BlockKeys(context, secret_id(config.integrity_secret))

    def shutdown(self) -> None:
        """Release the store (the last side using a real client closes it, once)."""
        self._lease.release()
