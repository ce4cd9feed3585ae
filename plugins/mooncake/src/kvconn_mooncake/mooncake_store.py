"""The real backend: ``mooncake.store.MooncakeDistributedStore`` behind :class:`Store`.

What this wrapper adds to the client, each from an observed behaviour
(``tests/MOONCAKE_NOTES.md``):

* ``setup`` against an address that accepts TCP but does not answer as a
  master (another service, a wedged master) retries for ~600 s *holding the
  GIL*, so no thread join can time it out. Connecting therefore starts with a
  probe that speaks the master's RPC framing (coro_rpc) with a deadline: only
  an address that answers as an RPC server within ``setup_timeout_s`` gets a
  ``setup``. A failed connect leaves the store *off* (every call fails fast
  with ``RPC_FAIL``); reconnects run in a background thread, at most every
  ``retry_interval_s``, never on the engine's path.
* Every call on the engine's path has a deadline (``store_timeout_s`` plus
  1 s per 256 MiB moved); buffers are registered inside those calls, as
  registering talks to the master's metadata server too. Calls run one at a
  time on a daemon thread, and the client releases the GIL while it waits on
  the network, so the engine stops waiting at the deadline: a wedged master
  (SIGSTOP) would otherwise hold a call for 30-60 s, a just-killed one for
  ~4.5 s. Past the deadline
  the call's keys fail (``RPC_FAIL``: no save, recompute) and the store is
  *tripped*: every call fails fast until a background probe (after the late
  call has returned, then a backoff doubling from ``retry_interval_s`` to
  ``max_backoff_s``) gets a timely answer again. A late call may still
  read or write its buffers: loads land in staging and every value is
  verified (see :mod:`kvconn_mooncake.integrity`), so that cannot reach a
  KV cache.
* With the master gone, the client's ``health_check()`` (microseconds) turns
  non-zero within a second and back to ``0`` once it has reconnected and
  re-mounted its segment, so every call is gated on it as well.
* Any call after ``close()`` crashes the process, so ``close`` is idempotent,
  every later call fails fast, and a client with a call still in flight is
  abandoned rather than closed.
"""

from __future__ import annotations

import collections
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvconn._install import install_extra

from .codes import OK, RPC_FAIL
from .config import RealStoreSettings

__all__ = ["MooncakeStore", "import_client", "probe_master"]

logger = logging.getLogger("kvconn_mooncake")

#: A coro_rpc request (yalantinglibs, the master's RPC framing) for function id 0, which no server registers:
#: a master answers at once with an error response starting with the same magic byte.
_RPC_MAGIC = 21
_RPC_PROBE = struct.pack("<BBBBIIII", _RPC_MAGIC, 0, 0, 0, 0x6B76, 0, 0, 0)
#: Extra time a store call may take per byte it moves (256 MiB/s, far below a healthy store).
_SECONDS_PER_BYTE = 1.0 / (256 << 20)
_PROBE_KEY = "kvconn/probe"


def import_client() -> Callable[[], Any]:
    """The client class; ``ImportError`` with the fix when the wheel is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        install = install_extra("kvconn-mooncake", "store", "plugins/mooncake")
        raise ImportError(
            f"the real Mooncake store needs its client: {install} (on Debian also: apt-get install libibverbs1 "
            f"librdmacm1; on a GPU host mooncake-transfer-engine instead): {exc}"
        ) from exc
    return MooncakeDistributedStore


def probe_master(host: str, port: int, timeout: float) -> str | None:
    """``None`` if ``host:port`` answers as a Mooncake master within ``timeout`` seconds, else why not."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_RPC_PROBE)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            answer = sock.recv(16)
    except TimeoutError:
        return f"no answer within {timeout:g} s (a wedged master, or not a master)"
    except OSError as exc:
        return f"not reachable ({exc.strerror or exc})"
    if not answer or answer[0] != _RPC_MAGIC:
        return f"not a Mooncake master (it answered {answer[:8]!r} to an RPC request)"
    return None


class _Busy(Exception):
    """A call is still running on the caller thread (one that timed out): the new one is not started."""


class _Caller:
    """Runs client calls one at a time on a daemon thread, so the engine can stop waiting at a deadline.

    A call that misses its deadline keeps running; until it returns, every
    new call raises :class:`_Busy` at once instead of queueing behind it.
    """

    def __init__(self) -> None:
        self.idle = threading.Event()
        self.idle.set()
        self._claim = threading.Lock()  # makes "idle? then busy" one step for concurrent callers
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._run, name="kvconn-mooncake-store", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """End the thread once the calls already queued (a late one, say) have run."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, box, done = item
            try:
                box.append(fn())
            except Exception as exc:  # re-raised in the caller's thread
                box.append(exc)
            self.idle.set()  # before done: the woken caller may start its next call at once
            done.set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()``'s result; ``TimeoutError`` past ``timeout`` seconds, :class:`_Busy` if a late call still runs."""
        with self._claim:
            if not self.idle.is_set():
                raise _Busy
            self.idle.clear()
        box: list[Any] = []
        done = threading.Event()
        self._queue.put((fn, box, done))
        if not done.wait(timeout):
            raise TimeoutError
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]


class MooncakeStore:
    """A :class:`~kvconn_mooncake.store.Store` over one Mooncake client."""

    def __init__(self, settings: RealStoreSettings, client_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self._factory = client_factory or import_client()
        self._caller = _Caller()
        self._lock = threading.Lock()  # guards _client, _buffers and the background thread's start
        self._client: Any = None
        self._unregistered: collections.deque[tuple[int, int]] = collections.deque()  # for the next call to register
        self._closed = False
        self._healthy = False
        self._tripped = False  # a call missed its deadline: off until the background probe answers in time
        self._background: threading.Thread | None = None
        self._next_connect = 0.0
        self._buffers: list[tuple[int, int]] = []
        self._connect()

    # ------------------------------------------------------------ connection

    def _off(self, why: str) -> None:
        logger.warning(
            "mooncake master %s %s: the store is off (no saves, no hits); retrying in the background every %g s",
            self.settings.master_server_address, why, self.settings.retry_interval_s,
        )  # fmt: skip

    def _connect(self) -> bool:
        """Probe, then set a client up, all within ``setup_timeout_s``; ``False`` (and logged) if that fails.

        The next attempt is due ``retry_interval_s`` after this one *ended*: a
        refused connect (no master yet) ends at once, so an engine started
        before its master connects within an interval of the master coming up,
        not after this attempt's whole ``setup_timeout_s`` deadline.
        """
        try:
            return self._try_connect()
        finally:
            self._next_connect = time.monotonic() + self.settings.retry_interval_s

    def _try_connect(self) -> bool:
        s = self.settings
        deadline = time.monotonic() + s.setup_timeout_s
        problem = probe_master(*s.master_host_port, s.setup_timeout_s)
        if problem is not None:
            self._off(problem)
            return False
        client = self._factory()
        args = (
            s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
            s.protocol, s.rdma_devices, s.master_server_address,
        )  # fmt: skip
        try:
            code = self._caller.call(lambda: client.setup(*args), max(deadline - time.monotonic(), 0.001))
        except (TimeoutError, _Busy):
            self._off(f"client setup did not finish within {s.setup_timeout_s:g} s")
            return False  # a client whose setup hangs is abandoned, never closed or reused
        if code != OK:
            self._off(f"client setup returned {code}")
            return False
        with self._lock:
            self._unregistered.clear()
            self._unregistered.extend(self._buffers)
            self._client = client
            self._healthy = True
        logger.info("mooncake client connected to master %s", s.master_server_address)
        return True

    def _in_background(self, work: Callable[[], object]) -> None:
        """Run ``work`` on the one background thread (connect or recover), unless it is busy already."""
        with self._lock:
            if self._closed or (self._background is not None and self._background.is_alive()):
                return
            self._background = threading.Thread(target=work, name="kvconn-mooncake-recover", daemon=True)
            self._background.start()

    def _recover(self) -> None:
        """After a missed deadline: wait for the late call, back off, probe; clear the trip once answered in time."""
        s = self.settings
        backoff = s.retry_interval_s
        while True:
            self._caller.idle.wait()
            time.sleep(backoff)
            if self._closed:
                return
            if self._answers_in_time():
                self._tripped = False
                logger.info("mooncake master %s answers in time again: store calls resume", s.master_server_address)
                return
            backoff = min(2 * backoff, s.max_backoff_s)

    def _answers_in_time(self) -> bool:
        """Whether the master answers a probe, and the client a lookup, within ``store_timeout_s``."""
        s, client = self.settings, self._client
        if client is None or probe_master(*s.master_host_port, s.store_timeout_s) is not None:
            return False
        try:
            return bool(self._caller.call(lambda: client.batch_is_exist([_PROBE_KEY]), s.store_timeout_s)[0] >= 0)
        except (TimeoutError, _Busy):
            return False

    def _ready(self) -> bool:
        """Whether a call may reach the client now (never after close; not while the store is off or tripped)."""
        if self._closed or self._tripped:
            return False
        if self._client is None:
            if time.monotonic() >= self._next_connect:
                self._in_background(self._connect)
            return False
        healthy = self._client.health_check() == 0
        if healthy != self._healthy:
            self._healthy = healthy
            if healthy:
                logger.info("mooncake master %s is back: store calls resume", self.settings.master_server_address)
            else:
                logger.warning(
                    "mooncake master %s is unreachable: saves are skipped and lookups miss until it is back",
                    self.settings.master_server_address,
                )
        return healthy

    def _call(self, name: str, keys: Sequence[str], fn: Callable[[Any], list[int]], nbytes: int = 0) -> list[int]:
        """``fn(client)`` within the deadline; ``RPC_FAIL`` per key if the store is off, busy or too late."""
        if not keys:
            return []
        if not self._ready():
            return [RPC_FAIL] * len(keys)
        with self._lock:
            registering = sum(size for _, size in self._unregistered)  # once per buffer: pinning may take a while
        timeout = self.settings.store_timeout_s + (nbytes + registering) * _SECONDS_PER_BYTE
        client = self._client

        def call() -> list[int]:
            self._register_pending(client)
            return fn(client)

        try:
            return list(self._caller.call(call, timeout))
        except _Busy:
            return [RPC_FAIL] * len(keys)
        except TimeoutError:
            self._tripped = True
            logger.warning(
                "mooncake %s of %d keys did not return within %.1f s (a wedged or lost master?): this step "
                "degrades, and the store is off until a background probe of master %s answers in time",
                name, len(keys), timeout, self.settings.master_server_address,
            )  # fmt: skip
            self._in_background(self._recover)
            return [RPC_FAIL] * len(keys)
        except Exception as exc:  # the client binding raised: this call degrades, like an error code
            logger.warning("mooncake %s of %d keys raised %s: %s; this step degrades", name, len(keys),
                           type(exc).__name__, exc)  # fmt: skip
            return [RPC_FAIL] * len(keys)

    # ---------------------------------------------------------------- Store

    def _register_pending(self, client: Any) -> None:
        """Register the buffers added since the last call (on the caller thread: registering may block too)."""
        while self._unregistered:
            ptr, size = self._unregistered.popleft()  # first: a register that raises is not retried forever
            code = client.register_buffer(ptr, size)
            if code != OK:
                logger.warning(
                    "mooncake register_buffer of %d bytes returned %s; transfers are tried anyway", size, code
                )

    def register_buffer(self, ptr: int, size: int) -> int:
        """Remember the buffer; the next store call registers it, within that call's deadline."""
        with self._lock:
            self._buffers.append((ptr, size))
            self._unregistered.append((ptr, size))
        return OK

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        return self._call("batch_is_exist", keys, lambda client: client.batch_is_exist(list(keys)))

    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        return self._batch("batch_put_from", keys, ptrs, sizes)

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        return self._batch("batch_get_into", keys, ptrs, sizes)

    def _batch(
        self, call: str, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """``call`` with one part per value, else its ``_multi_buffers`` variant."""
        nbytes = sum(map(sum, sizes))
        if all(len(p) == 1 for p in ptrs):
            flat_ptrs, flat_sizes = [p[0] for p in ptrs], [s[0] for s in sizes]
            return self._call(call, keys, lambda client: getattr(client, call)(keys, flat_ptrs, flat_sizes), nbytes)
        # The client converts any sequences itself: copying 256 part lists here would cost more than building them.
        multi = f"{call}_multi_buffers"
        return self._call(multi, keys, lambda client: getattr(client, multi)(keys, ptrs, sizes), nbytes)

    def close(self) -> None:
        """Close the client once; every later call fails fast (a call after close would crash)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        try:
            self._close_client(client)
        finally:
            self._caller.stop()

    def _close_client(self, client: Any) -> None:
        if client is None:
            return
        if not self._caller.idle.wait(self.settings.store_timeout_s):
            logger.warning("mooncake client abandoned, not closed: a store call is still running")
            return

        def close_client() -> None:
            for ptr, _ in self._buffers:
                client.unregister_buffer(ptr)
            client.close()

        try:
            self._caller.call(close_client, self.settings.setup_timeout_s)
        except (TimeoutError, _Busy):
            logger.warning("mooncake client close did not finish within %g s", self.settings.setup_timeout_s)
