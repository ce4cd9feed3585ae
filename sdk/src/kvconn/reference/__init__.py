"""The reference engine: a small, faithful driver for connectors.

A paged KV-cache manager with prefix caching and several KV-cache groups, a
scheduler with chunked prefill, preemption, async external loads, delayed
frees and failed-load recovery, and a worker holding real torch KV caches with
a deterministic model, so a wrong load changes the generated tokens. torch is
imported only when a worker is built.

Read by: the conformance suite's reference driver, ``kvconn simulate`` (through
:mod:`.simulate`), :mod:`kvconn.testing` and tests. Public: ``__all__`` below,
also importable as :mod:`kvconn.engine` (DESIGN.md promises both). It drives
connectors only through :mod:`kvconn.host`, never through ``pm.hook``. A change
here updates docs/architecture.md's map and the ``kvconn.reference`` layers
contract in ``pyproject.toml`` (simulate, engine, scheduler, cache manager, model).
"""

from __future__ import annotations

from .block_pool import Block, BlockPool
from .engine import Engine
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerConfig
from .shape import EngineShape
from .stats import EngineStats
from .worker import ReferenceWorker

__all__ = [
    "Block",
    "BlockPool",
    "Engine",
    "EngineShape",
    "EngineStats",
    "KVCacheManager",
    "ReferenceWorker",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
]
