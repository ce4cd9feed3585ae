"""kvconn-sglang: any kvconn store connector as SGLang's HiCache storage tier.

SGLang loads it by module path::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvconn", "module_path": "kvconn_sglang", "class_name": "KVConnStorage",
        "interface_v1": 1, "kvconn_store": "redis", "kvconn_config": {"url": "redis://..."}}'

:class:`KVConnStorage` (a ``HiCacheStorage``) is imported from SGLang only when
asked for, so ``import kvconn_sglang`` works without SGLang (the CLI, type
checks). The tier's work (keys, integrity, deadlines, degrade rules) is
:class:`~kvconn_sglang.tier.PageTier`'s, over the store connector's own side.
"""

from __future__ import annotations

from typing import Any

from .namespace import sglang_context
from .spec import StorageSpec, StoreSpecError
from .tier import PageTier

__all__ = ["CLASS_NAME", "KVConnStorage", "PageTier", "StorageSpec", "StoreSpecError", "extra_config", "sglang_context"]

#: The ``class_name`` SGLang's dynamic backend is given.
CLASS_NAME = "KVConnStorage"


def extra_config(store: str, config: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for store connector ``store`` with its ``config``."""
    return {
        "backend_name": "kvconn",
        "module_path": __name__,
        "class_name": CLASS_NAME,
        "interface_v1": 1,
        "kvconn_store": store,
        "kvconn_config": dict(config or {}),
        **options,
    }


def __getattr__(name: str) -> Any:
    if name == CLASS_NAME:  # imports SGLang: only when SGLang's factory asks for it
        from .storage import KVConnStorage

        return KVConnStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
