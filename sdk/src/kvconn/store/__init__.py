"""kvconn.store: write a store, get a correct connector.

:class:`BlockStore` is the protocol a store implements (batched ``contains``,
write-once ``put``, ``get`` into caller-given buffers, ``close``);
:class:`StoreConnector` turns one into a connector, with options
:class:`StoreConfig`. The worker side imports torch only where it is built.

Read by: store authors (plugins ``kvconn_offload``, ``kvconn_mooncake``,
``kvconn_redis``), the SGLang storage tier and the conformance suite's store
checks. Public: ``__all__`` below; the protocol's docstrings are the store
contract that docs/guide.md quotes word for word (``tests/test_docs.py`` checks
it) and :mod:`kvconn.testing.store_conformance` tests. A change here updates
those and the ``kvconn.store`` layers contract in ``pyproject.toml`` (connector,
its two sides, the shared side, guard and values, the protocol).
"""

from __future__ import annotations

from .config import LoadAsync, MaxBackoff, SaveAsync, SaveDecode, StoreConfig
from .connector import StoreConnector
from .guard import StoreGuard, StoreUnavailable
from .integrity import HEADER_BYTES, Integrity
from .keys import KEY_VERSION, BlockKeys
from .metadata import StoreBlock, StoreMetadata
from .protocol import BlockStore, PartsStore, ScatterStore
from .scheduler import StoreScheduler

__all__ = [
    "HEADER_BYTES",
    "KEY_VERSION",
    "BlockKeys",
    "BlockStore",
    "Integrity",
    "LoadAsync",
    "MaxBackoff",
    "PartsStore",
    "SaveAsync",
    "SaveDecode",
    "ScatterStore",
    "StoreBlock",
    "StoreConfig",
    "StoreConnector",
    "StoreGuard",
    "StoreMetadata",
    "StoreScheduler",
    "StoreUnavailable",
]
