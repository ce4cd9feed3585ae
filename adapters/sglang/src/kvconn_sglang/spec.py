"""What SGLang's extra config names: the store connector and its config, checked before any store opens."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvconn import ConnectorConfigError, KVConnError
from kvconn.introspection import build_config
from kvconn.store import StoreConnector

__all__ = ["StorageSpec", "StoreSpecError", "load_store_class"]


class StoreSpecError(KVConnError, ValueError):
    """The extra config does not name a usable kvconn store connector (said before SGLang starts serving)."""


@dataclass(frozen=True)
class StorageSpec:
    """``kvconn_store`` (a ``kvconn list`` name or ``"pkg.module:Class"``) and ``kvconn_config`` (its options)."""

    store: str
    config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSpec:
        extra = extra or {}
        store = extra.get("kvconn_store")
        if not isinstance(store, str) or not store:
            raise StoreSpecError(
                "--hicache-storage-backend-extra-config needs 'kvconn_store': a kvconn store connector's name "
                "(see `kvconn list`) or 'package.module:Class'"
            )
        config = extra.get("kvconn_config") or {}
        if not isinstance(config, Mapping):
            raise StoreSpecError(f"'kvconn_config' must be a JSON object of the store's options, got {config!r}")
        return cls(store, dict(config))


def load_store_class(store: str) -> type[StoreConnector]:
    """The connector class ``store`` names; :class:`StoreSpecError` when it is not a kvconn store connector.

    Only a :class:`~kvconn.store.StoreConnector` can be a storage tier: its store is
    what SGLang's pages go to. A connector with hooks of its own moves blocks
    its own way, which SGLang's HiCache has no place for.
    """
    from kvconn import load_connector_class

    cls = load_connector_class(store)
    if not (isinstance(cls, type) and issubclass(cls, StoreConnector)):
        raise StoreSpecError(
            f"connector {store!r} ({cls.__module__}.{cls.__qualname__}) is not a kvconn store connector: SGLang's "
            "HiCache storage tier hosts kvconn.store.StoreConnector subclasses (a BlockStore under the SDK's keys, "
            "integrity and deadlines); write the store as a BlockStore (docs/authoring.md) to serve SGLang"
        )
    return cls


def check_config(cls: type[StoreConnector], store: str, config: Mapping[str, Any]) -> None:
    """Validate ``config`` as ``load_connector`` will (a bad field is named before SGLang starts serving)."""
    try:
        build_config(cls, config, name=store)
    except ConnectorConfigError as exc:
        raise StoreSpecError(str(exc)) from None
