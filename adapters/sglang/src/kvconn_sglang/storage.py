"""``KVConnStorage``: the ``HiCacheStorage`` SGLang's dynamic backend loads (imports SGLang).

SGLang's factory imports ``module_path``, checks the class is a
``HiCacheStorage``, calls ``cls(storage_config, kwargs)`` and then
``register_mem_pool_host(pool)``; its controller then calls ``batch_exists``
from the prefetch thread, ``batch_get_v1`` from the prefetch I/O thread and
``batch_set_v1`` from the backup thread (``interface_v1``), or the generic
calls without it. Every call answers in the shape SGLang reads (a count, a
list of booleans, never ``None`` where a list is expected) and never raises:
a wrong answer or an exception there stops a request's prefetch or a backup,
so each call is wrapped once here, the failure logged and counted, and the
safe answer given (a miss, a skipped save).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .spec import StorageSpec
from .tier import PageTier

if TYPE_CHECKING:
    HiCacheStorage = object
else:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

__all__ = ["KVConnStorage"]

logger = logging.getLogger("kvconn.sglang")
T = TypeVar("T")


class KVConnStorage(HiCacheStorage):
    """Any kvconn store connector as SGLang's HiCache L3 tier (``kvconn_store`` and ``kvconn_config``)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.tier = PageTier(StorageSpec.from_extra_config(storage_config.extra_config), storage_config)
        self._failed: set[str] = set()

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        self.tier.register(mem_pool_host)

    # ------------------------------------------------------------ v1: zero copy

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._safe("batch_exists", lambda: self.tier.exists_prefix(keys), 0)

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._safe("batch_get_v1", lambda: self.tier.load_pages(keys, host_indices), [False] * len(keys))

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        return self._safe("batch_set_v1", lambda: self.tier.save_pages(keys, host_indices), [False] * len(keys))

    # ------------------------------------------------------------ generic calls (copies)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        landed = self._safe("batch_get", lambda: self.tier.load_flat(keys, target_locations), [False] * len(keys))
        return [t if ok else None for t, ok in zip(target_locations, landed, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        if values is None:
            return False
        return all(self._safe("batch_set", lambda: self.tier.save_flat(keys, values), [False] * len(keys)))

    # ------------------------------------------------------------ the rest

    def get_stats(self) -> Any:
        return dict(self.tier.stats.totals) if self.tier.ready else None

    def clear(self) -> None:
        """Stored pages are shared with other engines and write-once: kvconn never deletes them."""

    def close(self) -> None:
        self.tier.close()

    def _safe(self, what: str, call: Callable[[], T], fallback: T) -> T:
        try:
            return call()
        except Exception as exc:  # never into SGLang's threads: a miss or a skipped save instead
            if what not in self._failed:
                self._failed.add(what)
                logger.exception("kvconn %s: %s raised %s; answered as a miss (logged once)", self.tier.spec.store,
                                 what, type(exc).__name__)  # fmt: skip
            if self.tier.ready:
                self.tier.stats.degraded(f"{what}_raised", 1, f"{what} raised; answered as a miss")
            return fallback
