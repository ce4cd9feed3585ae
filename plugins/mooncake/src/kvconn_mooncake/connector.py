"""``MooncakeConnector``: a :class:`kvconn.store.StoreConnector` over a Mooncake store.

kvconn.store does the connector's work (which blocks, when, the key
namespace, the integrity header checked before any byte reaches a KV cache,
deadlines and trip/recover, blocks whose load failed not offered again);
this module only chooses and opens the store.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvconn import ConnectorConfigError, ConnectorLoadError
from kvconn.store import BlockStore, StoreConnector

from .config import MooncakeConfig, resolve_backend
from .embedded import EmbeddedStore, embedded_store
from .mooncake_store import import_client
from .store import MooncakeBlockStore, open_real

__all__ = ["MooncakeConnector", "open_store"]


class MooncakeConnector(StoreConnector):
    """Saves full KV blocks to a Mooncake store and loads prefix hits from it.

    Backends: the real ``MooncakeDistributedStore`` when a master is
    configured, else an embedded in-process store with the same semantics
    (see :class:`~kvconn_mooncake.config.MooncakeConfig`). A bad config, a
    missing client or an embedded store of another capacity fail here, at
    load time; a master that is down only turns the store off.
    """

    Config = MooncakeConfig
    config: MooncakeConfig

    def __init__(self, config: msgspec.Struct | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.settings = resolve_backend(self.config)
        self._embedded = _embedded(self.config) if self.settings is None else None
        self._factory = None if self.settings is None else _client_factory()

    @property
    def backend(self) -> str:
        """``"embedded"`` or ``"mooncake"`` (the real store)."""
        return "embedded" if self.settings is None else "mooncake"

    @property
    def in_process_state(self) -> bool:  # type: ignore[override]
        """The embedded store lives in this process: its scheduler and workers must share it."""
        return self.settings is None

    @property
    def inline_calls(self) -> bool:  # type: ignore[override]
        """The embedded store is memory of this process whose calls never wait (a lock held only for a copy):
        it is called inline, with no hand-off to a store thread, and engines may read into their memory in
        place (no late write can follow a call). The real store goes over the network: it keeps its deadline."""
        return resolve_backend(self.config) is None

    def open_store(self) -> BlockStore:
        if self._embedded is not None:
            return MooncakeBlockStore.embedded(self._embedded)
        assert self.settings is not None and self._factory is not None
        return open_real(self.settings, self._factory, self.config.timeout_s)


def open_store(config: MooncakeConfig) -> MooncakeBlockStore:
    """The store ``config`` selects, shared with the connectors of this process (close it once done)."""
    settings = resolve_backend(config)
    if settings is None:
        return MooncakeBlockStore.embedded(_embedded(config))
    return open_real(settings, _client_factory(), config.timeout_s)


def _embedded(config: MooncakeConfig) -> EmbeddedStore:
    try:
        return embedded_store(config.embedded_store, config.embedded_capacity_bytes)
    except ValueError as exc:
        raise ConnectorConfigError(
            f"invalid config for connector 'mooncake': field 'embedded_capacity_bytes': {exc}"
        ) from None


def _client_factory() -> Any:
    try:
        return import_client()
    except ImportError as exc:
        raise ConnectorLoadError(f"connector 'mooncake': {exc}") from exc
