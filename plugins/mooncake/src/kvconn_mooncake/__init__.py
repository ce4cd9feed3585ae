"""kvconn-mooncake: save and load KV-cache blocks through the Mooncake store.

The connector (``mooncake``) saves every full block on the step that fills
it and loads prefix hits, against the real ``MooncakeDistributedStore`` when
a master is configured, or an embedded in-process store with the same
semantics otherwise. Importing this package does not import torch or Mooncake.
"""

from __future__ import annotations

from .backends import StoreLease, acquire_store
from .config import ENV_VARS, MooncakeConfig, RealStoreSettings, resolve_backend
from .connector import MooncakeConnector
from .embedded import EmbeddedStore, embedded_store
from .keys import BlockKeys
from .metadata import BlockTransfer, MooncakeMetadata
from .mooncake_store import MooncakeStore
from .scheduler import SchedulerSide
from .store import Store
from .worker import WorkerSide

__all__ = [
    "ENV_VARS",
    "BlockKeys",
    "BlockTransfer",
    "EmbeddedStore",
    "MooncakeConfig",
    "MooncakeConnector",
    "MooncakeMetadata",
    "MooncakeStore",
    "RealStoreSettings",
    "SchedulerSide",
    "Store",
    "StoreLease",
    "WorkerSide",
    "acquire_store",
    "embedded_store",
    "resolve_backend",
]
