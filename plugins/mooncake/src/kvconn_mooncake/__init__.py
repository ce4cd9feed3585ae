"""kvconn-mooncake: save and load KV-cache blocks through the Mooncake store.

The connector (``mooncake``) is a :class:`kvconn.store.StoreConnector`: the
store is the real ``MooncakeDistributedStore`` when a master is configured,
or an embedded in-process store with the same semantics otherwise. Importing
this package does not import torch or Mooncake.
"""

from __future__ import annotations

from .config import ENV_VARS, MooncakeConfig, RealStoreSettings, resolve_backend
from .connector import MooncakeConnector, open_store
from .embedded import EmbeddedStore, embedded_store
from .store import MooncakeBlockStore, MooncakePartsStore, StoreError

__all__ = [
    "ENV_VARS",
    "EmbeddedStore",
    "MooncakeBlockStore",
    "MooncakeConfig",
    "MooncakeConnector",
    "MooncakePartsStore",
    "RealStoreSettings",
    "StoreError",
    "embedded_store",
    "open_store",
    "resolve_backend",
]
