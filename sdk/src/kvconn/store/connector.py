"""``StoreConnector``: a complete saving and loading connector over any :class:`BlockStore`.

A store author writes the store (four batched calls) and one method here::

    class RedisConnector(StoreConnector):
        Config = RedisConfig            # a StoreConfig subclass with the store's own fields

        def open_store(self) -> BlockStore:
            return RedisStore(self.config.url)

Everything else is the SDK's, once: lookups without side effects (memoised
per step), saves on the step that fills a block (every group, every layer),
the sliding-window cut, async loads on worker threads, the key namespace,
the integrity header checked before any byte reaches a KV cache, blocks whose
load failed not offered again for a while, deadlines and trip/recover for a
store that hangs or is down, delayed frees until saves land, and stats.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from ..connector import KVConnector
from .config import StoreConfig
from .metadata import StoreMetadata
from .protocol import BlockStore
from .scheduler import StoreScheduler
from .side import StoreSide

__all__ = ["StoreConnector"]


class StoreConnector(KVConnector):
    """Base class of store connectors: override :meth:`open_store` (and ``Config``)."""

    Config: ClassVar[type[msgspec.Struct]] = StoreConfig
    Metadata = StoreMetadata
    saves = True
    loads = True
    api_version = "1.0"
    scheduler_side = StoreScheduler
    worker_side = "kvconn.store.worker:StoreWorker"  # imports torch: only where a worker is built
    #: A store outside the engine's memory (Mooncake, Redis); a store on a local disk declares ``"disk"``.
    cache_tier = "remote"
    #: ``True`` only for a store in this process whose calls never wait (no I/O, no lock held while
    #: waiting, e.g. a dict): it is then called inline, on the engine's thread, with no hand-off to the
    #: store thread and no deadline. A store that can hang (a server, a file system) must leave it
    #: ``False``: the deadline is what bounds a hang. A property may decide it from the config (read once,
    #: when the connector is built). (Formerly ``in_process_store``, a name too close to
    #: ``in_process_state``, which says where the two sides may run, not how the store is called.)
    inline_calls: bool = False
    config: StoreConfig
    side: StoreSide

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "in_process_store" in vars(cls):
            warnings.warn(
                f"{cls.__qualname__}.in_process_store is deprecated: declare inline_calls = "
                f"{cls.__dict__['in_process_store']!r} (same meaning)",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.inline_calls = bool(cls.__dict__["in_process_store"])

    def __init__(self, config: msgspec.Struct | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not isinstance(self.config, StoreConfig):
            raise TypeError(f"{type(self).__qualname__}.Config must subclass kvconn.store.StoreConfig")
        self.side.attach(type(self).__name__, self.open_store, inline=self.inline_calls)

    @classmethod
    def fresh_store_config(cls, run: str, directory: Path) -> Mapping[str, Any] | None:
        """A namespace of the run's own: every key the connector writes carries it, so any store is empty
        for the run, however long it keeps its values. Override it when the store should also live in
        ``directory`` (a database file), so that a conformance run leaves nothing behind."""
        return {"namespace": f"{run}-{uuid.uuid4().hex[:16]}"}

    def open_store(self) -> BlockStore:
        """The store this connector uses, from ``self.config`` and ``self.context``.

        Called on a worker thread, in the background as soon as the side is
        built (so that the first step does not wait for it), and again by the
        first store call if that raised; a call that raises (a server that is
        down) or misses the deadline turns the store off until a background
        probe opens it.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must define open_store(self) -> BlockStore")
