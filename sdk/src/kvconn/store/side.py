"""What both sides of a store connector share: the store behind its guard, the keys, the stats."""

from __future__ import annotations

from collections.abc import Callable

from ..context import ConnectorContext
from .config import StoreConfig
from .guard import StoreGuard
from .integrity import secret_id
from .keys import BlockKeys
from .protocol import BlockStore
from .stats import StoreStats

__all__ = ["StoreSide"]


class StoreSide:
    """Built as ``Side(config, context)``; the connector then :meth:`attach`-es its ``open_store``."""

    def __init__(self, config: StoreConfig, context: ConnectorContext) -> None:
        self.config = config
        self.context = context
        self.keys = BlockKeys(context, config.namespace, secret_id(config.integrity_secret))
        #: counters; the worker side reports them (``get_kv_connector_stats``), the scheduler side logs
        self.stats = StoreStats("store connector")
        #: the store behind its deadlines, set by :meth:`attach`
        self.guard: StoreGuard

    def attach(self, name: str, open_store: Callable[[], BlockStore], *, inline: bool = False) -> None:
        """Use the store ``open_store`` opens (lazily, on the guard's thread), logging as ``name``.

        ``inline``: call it on the caller's thread, without deadlines (see :class:`StoreGuard`).
        """
        self.stats.name = f"{name} connector"
        self.guard = StoreGuard(name, open_store, timeout_s=self.config.timeout_s,
                                retry_interval_s=self.config.retry_interval_s,
                                max_backoff_s=self.config.max_backoff_s, inline=inline)  # fmt: skip

    def shutdown(self) -> None:
        self.guard.close()
