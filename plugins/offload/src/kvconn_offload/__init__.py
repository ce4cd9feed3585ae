"""kvconn-offload: CPU offloading of KV-cache blocks to a host-memory pool.

Connector name ``offload``. The scheduler side keeps an LRU (or FIFO) index
of block hashes over a fixed pool of host slots, saves each full block on the
step that fills it and loads the longest offloaded prefix on a hit (by
default in the step that computes the rest of the prompt where the KV caches
are in host memory, async on an accelerator: ``load_async``);
the worker side owns the pool (pinned when an accelerator is present, and
committed when the KV caches are registered: all of ``pool_bytes`` is taken
then, so no save faults pages in during a step) and moves blocks with
batched gathers/scatters.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import OffloadConfig
from .connector import OffloadConnector
from .manager import Entry, OffloadManager
from .metadata import BlockTransfer, OffloadMetadata
from .scheduler import OffloadScheduler

# The copy code and the worker side import torch: loaded on first use, so `kvconn list` stays fast.
_LAZY = {"BlockCopier": ".copy", "CopyPlan": ".copy", "wide_rows": ".copy", "OffloadWorker": ".worker"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockCopier",
    "BlockTransfer",
    "CopyPlan",
    "Entry",
    "OffloadConfig",
    "OffloadConnector",
    "OffloadManager",
    "OffloadMetadata",
    "OffloadScheduler",
    "OffloadWorker",
    "wide_rows",
]
