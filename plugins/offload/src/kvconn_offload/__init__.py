"""kvconn-offload: CPU offloading of KV-cache blocks to a host-memory pool.

Connector name ``offload``. The scheduler side keeps an LRU (or FIFO) index
of block hashes over a fixed pool of host slots, saves each full block on the
step that fills it and loads the longest offloaded prefix on a hit (async);
the worker side owns the pool (pinned when an accelerator is present) and
moves blocks with batched gathers/scatters.
"""

from __future__ import annotations

from .config import OffloadConfig
from .connector import OffloadConnector
from .copy import BlockCopier, CopyPlan, wide_rows
from .manager import Entry, OffloadManager
from .metadata import BlockTransfer, OffloadMetadata

__all__ = [
    "BlockCopier",
    "BlockTransfer",
    "CopyPlan",
    "Entry",
    "OffloadConfig",
    "OffloadConnector",
    "OffloadManager",
    "OffloadMetadata",
    "wide_rows",
]
