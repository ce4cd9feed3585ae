"""Deadlines, and trip and recover, around every call to a store.

A store that hangs (a stalled server) or is down must cost the engine at most
one deadline, not one per call: each call runs on a worker thread and the
caller stops waiting at ``timeout_s``. A call that misses its deadline or
raises *trips* the guard: every later call fails at once (the step degrades:
no save, recompute) until a background probe, after a backoff that doubles
from ``retry_interval_s`` up to ``max_backoff_s``, gets a timely answer. The
store is opened on a worker thread too (in the background when the guard is
built, else by the first call), so a store that cannot be reached at start-up
is the same "down" case, retried in the background.

A store declared in-process (``inline``: its calls do no I/O and never wait,
:attr:`kvconn.store.StoreConnector.inline_calls`) is called on the
caller's thread instead: no hand-off, which costs a thread switch per call
(milliseconds on a loaded machine), and no deadline, which such a store never
needs. A call that raises still trips it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from .protocol import BlockStore

__all__ = ["StoreGuard", "StoreUnavailable"]

logger = logging.getLogger("kvconn.store")

T = TypeVar("T")
_PROBE_KEY = b"kvconn/probe"


class StoreUnavailable(Exception):
    """The store is tripped, down or missed its deadline: the caller degrades."""


class StoreGuard:
    """One store behind deadlines; ``open_store`` runs on a worker thread: at once, then in calls while none is open."""

    def __init__(
        self,
        name: str,
        open_store: Callable[[], BlockStore],
        *,
        timeout_s: float,
        retry_interval_s: float,
        max_backoff_s: float,
        threads: int = 4,
        inline: bool = False,
    ) -> None:
        self.name = name
        #: calls run on the caller's thread, without a deadline (a store that never waits)
        self.inline = inline
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_backoff_s = max_backoff_s
        self._open = open_store
        self._store: BlockStore | None = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kvconn-store-{name}")
        self._lock = threading.Lock()
        self._tripped = False
        self._closed = threading.Event()
        #: how many times the store was tripped (a stat for tests and operators)
        self.trips = 0
        # Start a pool thread and open the store now, so that the first step pays for neither; the open runs
        # on a daemon thread (a side that never calls its store must not wait for it at exit), and a store
        # that cannot be opened yet is opened by the first call that needs it, as before. Inline: opened here
        # (an in-process store opens at once), no thread (only a probe uses the pool).
        if inline:
            self._open_early()
        else:
            self._pool.submit(lambda: None)
            threading.Thread(target=self._open_early, name=f"kvconn-store-{name}-open", daemon=True).start()

    @property
    def available(self) -> bool:
        return not self._tripped and not self._closed.is_set()

    @property
    def store(self) -> BlockStore | None:
        """The store once opened (``None`` before): for what a caller may ask of its type, never to call it."""
        return self._store

    def _store_now(self) -> BlockStore:
        if self._store is not None:  # open: no lock (close() may race a call either way)
            return self._store
        with self._lock:
            if self._store is None:
                if self._closed.is_set():  # never open a store that close() would not see
                    raise StoreUnavailable(f"{self.name} store is closed")
                self._store = self._open()
            return self._store

    def _open_early(self) -> None:
        try:
            self._store_now()
        except Exception:  # down or unreachable at start-up: the first call opens it, or trips the store
            return

    def submit(self, what: str, fn: Callable[[BlockStore], T]) -> Future[T]:
        """Run ``fn(store)`` on a worker thread (inline: now); :class:`StoreUnavailable` at once when tripped."""
        if not self.available:
            raise StoreUnavailable(f"{self.name} store is off")
        if not self.inline:
            return self._pool.submit(lambda: fn(self._store_now()))
        future: Future[T] = Future()
        try:
            future.set_result(fn(self._store_now()))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def result(self, what: str, future: Future[T], timeout: float | None = None) -> T:
        """``future``'s result within the deadline; trips and raises :class:`StoreUnavailable` otherwise."""
        try:
            return future.result(self.timeout_s if timeout is None else timeout)
        except FutureTimeout:
            self.trip(f"{what} did not answer within {self.timeout_s:g} s")
        except Exception as exc:
            self.trip(f"{what} raised {type(exc).__name__}: {exc}")
        raise StoreUnavailable(f"{self.name} store: {what} failed")

    def call(self, what: str, fn: Callable[[BlockStore], T]) -> T:
        """``fn(store)`` within the deadline; :class:`StoreUnavailable` when tripped, late or raising."""
        if not self.inline:
            return self.result(what, self.submit(what, fn))
        if not self.available:
            raise StoreUnavailable(f"{self.name} store is off")
        try:
            return fn(self._store_now())
        except Exception as exc:
            self.trip(f"{what} raised {type(exc).__name__}: {exc}")
            raise StoreUnavailable(f"{self.name} store: {what} failed") from exc

    def trip(self, why: str) -> None:
        """Turn the store off and start probing it in the background (once per trip)."""
        with self._lock:
            if self._tripped or self._closed.is_set():
                return
            self._tripped = True
            self.trips += 1
        logger.warning(
            "%s store: %s; it is off (no saves, no hits) until a probe answers in time (first in %g s)",
            self.name, why, self.retry_interval_s,
        )  # fmt: skip
        threading.Thread(target=self._recover, name=f"kvconn-store-{self.name}-probe", daemon=True).start()

    def _recover(self) -> None:
        backoff = self.retry_interval_s
        while not self._closed.wait(backoff):
            future = self._pool.submit(lambda: self._store_now().contains([_PROBE_KEY]))
            try:
                future.result(self.timeout_s)
            except Exception:  # late, raising or not opening: still down
                backoff = min(2 * backoff, self.max_backoff_s)
                continue
            self._tripped = False
            logger.info("%s store answers in time again: saves and lookups resume", self.name)
            return

    def close(self) -> None:
        """Close the store once (unless a late call still holds it) and stop the threads."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception as exc:
                logger.warning("%s store: close raised %s: %s", self.name, type(exc).__name__, exc)
