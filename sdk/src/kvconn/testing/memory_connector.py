"""``MemoryConnector``: the store connector over an in-process store, with fault injection, for tests.

Load it as ``"kvconn.testing.memory_connector:MemoryConnector"``. It is the
connector the engine and fault tests run: a :class:`kvconn.store.StoreConnector`
over :class:`~kvconn.testing.memory_store.MemoryStore` (the store ``store``,
shared by every connector of that name in the process), so everything a
storage connector must get right (lookups, saves on the step that fills a
block, async loads, the integrity check, cool-down of failed blocks, delayed
frees until saves land) is the code every store connector runs. Loads are
sync unless ``load_async``. The store is a dict in this process, so it is
called inline (:attr:`~kvconn.store.StoreConnector.inline_calls`): no
hand-off to a store thread, no deadline; and it writes values from parts, so
saves read the KV caches in place.

Fault injection for recovery tests:

* ``fail_from_block``: loads fail from that block of what each request loads
  in each KV-cache group on. The store reads those values back damaged, so
  the integrity check rejects them and the engine recomputes the blocks; the
  worker then fills them with garbage, so output stays exact only if the
  engine never uses what a failed load left.
* ``fail_hook``: the named hook raises on every call.
* The store's own switches, :func:`kvconn.testing.memory_store.faults`:
  ``down`` and ``corrupt``. Not ``stall``: a stalled inline call would stall
  the engine; stall :class:`~kvconn.testing.memory_store.MemoryStoreConnector`,
  which keeps the deadlines of a store that can hang.

The conformance suite's deliberately broken connectors, and tests of a
connector misbehaving in one hook, subclass the hook-level
:class:`kvconn.testing.raw_hook_connector.HookReferenceConnector` instead: a
store connector's hooks live on its sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from ..hookspecs import HOOK_NAMES, ROLE_HOOKS
from ..store import BlockStore, LoadAsync
from .memory_store import MemoryStore, MemoryStoreConfig, MemoryStoreConnector
from .memory_store import fresh_store as fresh_namespace

__all__ = ["MemoryConfig", "MemoryConnector", "PartsMemoryStore", "fresh_namespace"]


class PartsMemoryStore(MemoryStore):
    """:class:`MemoryStore` as a :class:`~kvconn.store.PartsStore`: saves of host KV caches skip staging.

    (``MemoryStoreConnector``'s plain store keeps the staging path under test.)
    """

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        return self.put(keys, [b"".join(value) for value in parts])


class MemoryConfig(MemoryStoreConfig, kw_only=True):
    """``MemoryStoreConfig`` with sync loads by default and the injected faults (see the module docstring)."""

    load_async: LoadAsync = False
    fail_from_block: (
        Annotated[int, msgspec.Meta(ge=0, description="loads fail from this block of each request's loads on")] | None
    ) = None
    fail_hook: Annotated[str, msgspec.Meta(description="a hook that raises on every call ('': none)")] = ""

    def __post_init__(self) -> None:
        if self.fail_hook and self.fail_hook not in HOOK_NAMES:
            raise ValueError(f"fail_hook {self.fail_hook!r} is not a hook; hooks: {', '.join(sorted(HOOK_NAMES))}")


class MemoryConnector(MemoryStoreConnector):
    """:class:`~kvconn.testing.memory_store.MemoryStoreConnector` with the faults of :class:`MemoryConfig`."""

    Config = MemoryConfig
    inline_calls = True
    worker_side = "kvconn.testing.memory_worker:MemoryWorker"  # imports torch: only where a worker is built
    config: MemoryConfig

    def __init__(self, config: MemoryConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.config.fail_hook in ROLE_HOOKS[self.role.value]:
            setattr(self.side, self.config.fail_hook, self._injected_failure)

    def open_store(self) -> BlockStore:
        return PartsMemoryStore(self.config.store)

    def _injected_failure(self) -> None:
        raise RuntimeError(f"injected failure in {self.config.fail_hook}")
