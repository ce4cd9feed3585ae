"""``PageTier``: SGLang's pages through a kvconn store connector, under the store layer's rules.

The store connector is loaded by name for the worker role with SGLang's context
(:func:`~kvconn_sglang.namespace.sglang_context`); its side holds what every
engine seam shares: the store behind its guard (a deadline on every call, trip
and recover), the key namespace and the integrity header. This module only
maps SGLang's calls onto them:

* lookups count the leading pages stored (SGLang's ``batch_exists``);
* saves seal each page (header over its bytes, read in place) and put them in
  one batched call, from the pool's memory when the store is a
  :class:`~kvconn.store.PartsStore`;
* loads read into staging, verify every value, and copy only verified pages
  into the pool, when the store keeps a deadline: a get past its deadline may
  still write after SGLang has freed and reused the pages. A store called
  inline (:attr:`~kvconn.store.StoreConnector.inline_calls`: in this process,
  no call outlives its caller) that reads into parts
  (:class:`~kvconn.store.ScatterStore`) reads straight into the pages, each
  verified there before the call returns; a page that fails is zeroed and
  answered not loaded. SGLang's controller counts only the leading pages
  answered loaded and inserts only those into its tree (the rest of the slots
  go back to the host pool), so a failed page is never read.

Nothing raises into SGLang: a store that is down, late or raising gives misses
and skipped saves, counted in :attr:`stats` (logged once per kind).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvconn import KVConnectorRole
from kvconn.introspection import build_config
from kvconn.store import HEADER_BYTES, BlockStore, PartsStore, ScatterStore, StoreConnector, StoreUnavailable
from kvconn.store.layout import StagingBuffers
from kvconn.store.values import explain, judge, seal_parts

from .namespace import namespace_suffix, sglang_context
from .pages import PageViews, flat_views
from .spec import StorageSpec, check_config, load_store_class

__all__ = ["PageTier"]

logger = logging.getLogger("kvconn.sglang")
T = TypeVar("T")

#: The layout name of values written through SGLang's generic (copying) calls: flat pages in
#: ``get_data_page`` order, never to be read as zero-copy pages (other order) or the reverse.
GENERIC = "generic-flat"


class PageTier:
    """One SGLang rank's storage tier over the store connector ``spec`` names."""

    def __init__(self, spec: StorageSpec, storage_config: Any, store_class: type[StoreConnector] | None = None) -> None:
        """``store_class``: the connector class to run in place of the one ``spec`` names (the checks inject faults
        into its store with a subclass); its config is still ``spec``'s."""
        self.spec = spec
        self.storage_config = storage_config
        self.store_class = store_class or load_store_class(spec.store)
        check_config(self.store_class, spec.store, spec.config)
        self.connector: Any = None
        self.views: PageViews | None = None
        self._judged: tuple[BlockStore | None, bool, bool] = (None, False, False)
        self._staging = StagingBuffers()

    # ------------------------------------------------------------ set-up

    def register(self, pool: Any) -> None:
        """Build the store connector for ``pool``'s pages (its context names their meaning)."""
        if self.connector is not None:
            self.close()
        config = dict(self.spec.config)
        own = config.get("namespace", "")
        config["namespace"] = f"{own}|sglang|{namespace_suffix(self.storage_config, pool)}"
        context = sglang_context(self.storage_config, pool)
        self.views = PageViews(pool)
        settings = build_config(self.store_class, config, name=self.spec.store)  # checked at start: never raises here
        self.connector = self.store_class(settings, role=KVConnectorRole.WORKER, context=context)
        side = self.connector.side
        self.guard = side.guard
        self.keys = side.keys
        self.integrity = side.integrity
        self.stats = side.stats
        self.stats.name = f"{self.spec.store} store (SGLang HiCache)"
        self._generic_digest = _generic_digest(pool)

    @property
    def ready(self) -> bool:
        return self.connector is not None

    def key(self, page_hash: str) -> bytes:
        return self.keys.key(0, page_hash.encode())

    def _kinds(self) -> tuple[BlockStore | None, bool, bool]:
        """The store, whether it is a PartsStore and a ScatterStore: judged once per store opened (a protocol
        ``isinstance`` walks the protocol's attributes, too slow for every call)."""
        store = self.guard.store
        if store is not self._judged[0]:
            self._judged = (store, isinstance(store, PartsStore), isinstance(store, ScatterStore))
        return self._judged

    def _call(self, what: str, fn: Callable[[BlockStore], T]) -> T:
        return self.guard.call(what, fn)

    # ------------------------------------------------------------ lookups

    def exists_prefix(self, page_hashes: Sequence[str]) -> int:
        """How many leading pages are stored (a store that cannot answer: none)."""
        if not page_hashes:
            return 0
        keys = [self.key(h) for h in page_hashes]
        try:
            found = list(self._call("contains", lambda store: store.contains(keys)))
        except StoreUnavailable:
            self.stats.degraded("lookup_failed_store_off", len(keys), "lookups failed (the store is off); misses")
            return 0
        hits = found.index(False) if False in found else len(found)
        self.stats.count("pages_found", hits)
        return hits

    # ------------------------------------------------------------ zero-copy pages

    def save_pages(self, page_hashes: Sequence[str], host_indices: Any) -> list[bool]:
        """Seal and put each page (read in place); per page, whether the store holds it now."""
        assert self.views is not None
        keys, pages = self._paired(page_hashes, host_indices)
        return self._put(keys, pages, self.views.digest, self.views.page_bytes)

    def load_pages(self, page_hashes: Sequence[str], host_indices: Any) -> list[bool]:
        """Read, verify and land each page; per page, whether it landed (verified) in the pool."""
        assert self.views is not None
        keys, pages = self._paired(page_hashes, host_indices)
        return self._get(keys, pages, self.views.digest, self.views.page_bytes)

    def _paired(self, page_hashes: Sequence[str], host_indices: Any) -> tuple[list[bytes], list[list[memoryview]]]:
        """Each page's key and its views; ``ValueError`` (before any store call) when the slots hold fewer pages."""
        assert self.views is not None
        pages = self.views.pages(host_indices)
        if len(pages) < len(page_hashes):
            raise ValueError(f"{len(page_hashes)} page keys for host slots of {len(pages)} pages")
        return [self.key(h) for h in page_hashes], pages[: len(page_hashes)]

    # ------------------------------------------------------------ generic (copying) calls

    def save_flat(self, page_hashes: Sequence[str], tensors: Sequence[Any]) -> list[bool]:
        """SGLang's generic ``batch_set``: each value is a flat page tensor."""
        keys = [self.key(h) for h in page_hashes]
        pages = [[view] for view in flat_views(tensors)]
        return self._put(keys, pages, self._generic_digest, None)

    def load_flat(self, page_hashes: Sequence[str], tensors: Sequence[Any]) -> list[bool]:
        """SGLang's generic ``batch_get`` into flat page tensors (contiguous host tensors, written in place)."""
        keys = [self.key(h) for h in page_hashes]
        pages = [[view] for view in flat_views(tensors)]
        return self._get(keys, pages, self._generic_digest, None)

    # ------------------------------------------------------------ the two directions

    def _put(self, keys: list[bytes], pages: list[list[memoryview]], digest: bytes, size: int | None) -> list[bool]:
        """``size``: every page's payload bytes when they share one (zero-copy pages), else ``None``."""
        if not keys:
            return []
        values = seal_parts(self.integrity, keys, digest, pages, size)
        try:
            if self._kinds()[1]:
                stored = list(self._call("put", lambda store: store.put_parts(keys, values)))  # type: ignore[attr-defined]
            else:
                joined = [b"".join(parts) for parts in values]
                stored = list(self._call("put", lambda store: store.put(keys, joined)))
        except StoreUnavailable:
            self.stats.degraded("save_failed_store_off", len(keys), "saves skipped (the store is off, late or raised)")
            return [False] * len(keys)
        if len(stored) != len(keys):
            self.stats.degraded("save_failed_answer", len(keys), "the store answered a put with the wrong count")
            return [False] * len(keys)
        saved = sum(stored)
        self.stats.count("pages_saved", saved)
        if size is not None:
            self.stats.count("bytes_saved", saved * size)
        else:
            self.stats.count(
                "bytes_saved", sum(sum(p.nbytes for p in page) for page, ok in zip(pages, stored, strict=True) if ok)
            )
        self.stats.degraded("save_failed_refused", len(keys) - saved, "the store refused pages (full?)")
        return [bool(ok) for ok in stored]

    def _get(self, keys: list[bytes], pages: list[list[memoryview]], digest: bytes, size: int | None) -> list[bool]:
        """``size``: every page's payload bytes when they share one (zero-copy pages), else ``None``."""
        if not keys:
            return []
        if self.guard.inline and self._kinds()[2]:
            verdicts = self._get_in_place(keys, pages, digest, size)
        else:
            verdicts = self._get_staged(keys, pages, digest, size)
        if verdicts is None:
            self.stats.degraded("load_failed_store_off", len(keys), "loads failed (the store is off, late or raised)")
            return [False] * len(keys)
        landed = [verdict is None for verdict in verdicts]
        for verdict in verdicts:
            if verdict is not None:
                self.stats.degraded(f"load_failed_{verdict}", 1, _why(verdict))
        self.stats.count("pages_loaded", sum(landed))
        return landed

    def _get_staged(
        self, keys: list[bytes], pages: list[list[memoryview]], digest: bytes, size: int | None
    ) -> list[str | None] | None:
        """Read into staging of its own (dropped if the call is late), verify, copy verified pages in."""
        strides = [HEADER_BYTES + sum(p.nbytes for p in page) for page in pages]
        buffer = self._staging.take(sum(strides))
        staging = memoryview(buffer)
        views, offset = [], 0
        for stride in strides:
            views.append(staging[offset : offset + stride])
            offset += stride
        try:
            lengths = list(self._call("get", lambda store: store.get(keys, views)))
        except StoreUnavailable:
            return None  # the staging is dropped: a late get may still write it
        if len(lengths) != len(keys):
            return None
        verdicts: list[str | None] = []
        for key, length, view, page in zip(keys, lengths, views, pages, strict=True):
            verdict = judge(self.integrity, key, digest, length, view[:HEADER_BYTES], [view[HEADER_BYTES:]], size)
            if verdict is None:
                at = HEADER_BYTES
                for part in page:
                    part[:] = view[at : at + part.nbytes]
                    at += part.nbytes
            verdicts.append(verdict)
        self._staging.give([buffer])
        return verdicts

    def _get_in_place(
        self, keys: list[bytes], pages: list[list[memoryview]], digest: bytes, size: int | None
    ) -> list[str | None] | None:
        """Read straight into the pages (a store called inline: no call outlives this one); zero each that fails.

        What the store wrote is verified where it landed; a call that raises or answers the wrong count leaves
        every page zeroed and none loaded.
        """
        headers = memoryview(bytearray(len(keys) * HEADER_BYTES))
        heads = [headers[at : at + HEADER_BYTES] for at in range(0, headers.nbytes, HEADER_BYTES)]
        parts = [[head, *page] for head, page in zip(heads, pages, strict=True)]
        try:
            lengths = list(self._call("get", lambda store: store.get_parts(keys, parts)))  # type: ignore[attr-defined]
        except StoreUnavailable:
            lengths = []
        if len(lengths) != len(keys):
            for page in pages:
                _zero(page)
            return None
        integrity = self.integrity
        verdicts = [
            judge(integrity, key, digest, length, head, page, size)
            for key, length, head, page in zip(keys, lengths, heads, pages, strict=True)
        ]
        for verdict, page in zip(verdicts, pages, strict=True):
            if verdict is not None:
                _zero(page)
        return verdicts

    def close(self) -> None:
        if self.connector is not None:
            try:
                self.connector.side.shutdown()
            except Exception as exc:  # closing must never raise into SGLang's detach
                logger.warning("kvconn store %s: close raised %s: %s", self.spec.store, type(exc).__name__, exc)
            self.connector = None


def _zero(page: Sequence[memoryview]) -> None:
    for part in page:
        part[:] = bytes(part.nbytes)


def _generic_digest(pool: Any) -> bytes:
    from kvconn.store.integrity import layout_digest

    page = pool.get_dummy_flat_data_page()
    return layout_digest([(GENERIC, tuple(page.shape), str(page.dtype))])


def _why(verdict: str) -> str:
    instead = "SGLang's prefetch stops before it"
    return explain(verdict, unit="page", layout="page layout", lands_in="the host pool", instead=instead)
