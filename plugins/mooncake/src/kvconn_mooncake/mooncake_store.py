"""The real backend: connecting ``mooncake.store.MooncakeDistributedStore``, and closing it safely.

What this module adds to the client, each from an observed behaviour
(``tests/MOONCAKE_NOTES.md``); deadlines on every call, trip and recover
are :class:`kvconn.store.StoreGuard`'s (the store is opened on its threads):

* ``setup`` against an address that accepts TCP but does not answer as a
  master (another service, a wedged master) retries for ~600 s *holding the
  GIL*, so no deadline can cut it short. Connecting therefore starts with a
  probe that speaks the master's RPC framing (coro_rpc) with a deadline: only
  an address that answers as an RPC server within ``setup_timeout_s`` gets a
  ``setup``. A failed connect raises: the store is off, and the guard's
  background probe connects again (backoff from ``retry_interval_s``).
* With the master gone, the client's ``health_check()`` (microseconds) turns
  non-zero within a second and back to ``0`` once it has reconnected and
  re-mounted its segment: every call checks it first and raises while it is
  non-zero, rather than waiting ~4.5 s for the client's own RPC failure.
* Any call after ``close()`` crashes the process, so :class:`SharedClient`
  refuses calls once closing, and a client with a call still in flight (one
  past its deadline) is abandoned rather than closed.
* A segment is allocated but not written: the first put into each page of
  it pays a page fault, 5x the put's time. ``warm_segment`` (on by default)
  faults the client's own segment in once at connect time, without writing
  it (:func:`warm_segment`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from kvconn.install import install_extra

from .codes import OK
from .config import RealStoreSettings

__all__ = ["SharedClient", "connect", "import_client", "probe_master", "warm_segment"]

logger = logging.getLogger("kvconn_mooncake")

T = TypeVar("T")

#: ``madvise`` advice: fault pages in writable, as a write would, without writing them (Linux 5.14+).
MADV_POPULATE_WRITE = 23


#: A coro_rpc request (yalantinglibs, the master's RPC framing) for function id 0, which no server registers:
#: a master answers at once with an error response starting with the same magic byte.
_RPC_MAGIC = 21
_RPC_PROBE = struct.pack("<BBBBIIII", _RPC_MAGIC, 0, 0, 0, 0x6B76, 0, 0, 0)


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


def connect(settings: RealStoreSettings, factory: Callable[[], Any]) -> Any:
    """A client set up against ``settings``' master; ``ConnectionError`` (why) when that fails.

    Bounded by ``setup_timeout_s``: the probe first, ``setup`` only once it answered.
    """
    s = settings
    problem = probe_master(*s.master_host_port, s.setup_timeout_s)
    if problem is not None:
        raise ConnectionError(f"mooncake master {s.master_server_address} {problem}")
    client = factory()
    code = client.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
                        s.protocol, s.rdma_devices, s.master_server_address)  # fmt: skip
    if code != OK:
        raise ConnectionError(f"mooncake client setup against master {s.master_server_address} returned {code}")
    logger.info("mooncake client connected to master %s", s.master_server_address)
    if s.warm_segment:
        try:
            warm_segment(client, s.global_segment_size)
        except Exception as exc:  # an optimisation only: the store works without it
            logger.warning("mooncake segment warm-up failed, saves pay first-touch page faults: %r", exc)
    return client


def warm_segment(client: Any, segment_bytes: int) -> int:
    """Fault in the memory of the client's own segment, so that no save pays a first-touch page fault; its bytes.

    Mooncake maps a segment without touching it: a put into a part never
    written faults in a page per 4 KiB (and the kernel zeroes each), and a
    12 MiB put took 5-6x as long as one into pages already there
    (benchmarks/history/2026-log.md, "Mooncake's segment faulted in at connect time").
    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) faults pages in *without
    writing them*: whatever a page holds (another client's value, put there the
    moment the segment was mounted) stays as it is, the master stores nothing,
    and nothing is evicted. The binding does not say where the segment is, so a
    1-byte probe value placed in this client's segment (``preferred_segment``)
    names an address in it, and is removed again; the advice covers
    ``segment_bytes`` on either side of it, within the mapping that holds it
    (the whole segment, wherever the probe landed, and never more than twice
    its size, should Mooncake carve it out of a larger arena). Raises
    ``OSError`` (with why) when the probe landed in another client's segment,
    the address is in no private anonymous mapping of this process, or the
    kernel refuses the advice; :func:`connect` logs it and connects anyway.
    """
    from mooncake.store import ReplicateConfig

    started = time.perf_counter()
    probe = bytearray(1)
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    config = ReplicateConfig()
    config.preferred_segment = own = client.get_hostname()
    key = f"kvconn-warm-probe-{uuid.uuid4().hex}"
    client.register_buffer(ptr, len(probe))
    try:
        if client.batch_put_from([key], [ptr], [len(probe)], config) != [OK]:
            raise OSError("the probe value could not be stored")
        try:
            buffer = client.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor
        finally:
            client.remove(key)
    finally:
        client.unregister_buffer(ptr)
    if buffer.transport_endpoint != own:
        raise OSError(f"the probe landed in segment {buffer.transport_endpoint!r}, not this client's ({own!r})")
    address = int(buffer.buffer_address)
    start, end = _anonymous_mapping(address)
    page = mmap.PAGESIZE
    start = max(start, (address - segment_bytes) // page * page)
    end = min(end, -(-(address + segment_bytes) // page) * page)
    if _libc().madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_POPULATE_WRITE) refused: {os.strerror(errno)} (Linux 5.14+ needed)")
    logger.info("mooncake segment faulted in: %d MiB in %.2f s", (end - start) >> 20, time.perf_counter() - started)
    return end - start


def _anonymous_mapping(address: int) -> tuple[int, int]:
    """The ``[start, end)`` of this process's private anonymous mapping holding ``address``; ``OSError`` if none."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                if fields[1] != "rw-p" or fields[4] != "0" or len(fields) > 5:  # perms, inode, path
                    raise OSError(f"the segment's address is in mapping {line.strip()!r}, not private anonymous memory")
                return start, end
    raise OSError(f"the segment's address {address:#x} is in no mapping of this process")


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class SharedClient:
    """One client, used by every side of this process with the same settings; closed once, never under a call."""

    def __init__(self, client: Any, close_timeout_s: float) -> None:
        self.client = client
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Condition()
        self._calls = 0
        self._closed = False
        self._buffers: list[int] = []

    def call(self, fn: Callable[[Any], T]) -> T:
        """``fn(client)``; ``ConnectionError`` once closed, or while the client reports its master unreachable."""
        with self._lock:
            if self._closed:
                raise ConnectionError("the mooncake client is closed")
            self._calls += 1
        try:
            health = self.client.health_check()
            if health != 0:
                raise ConnectionError(f"the mooncake master is unreachable (health_check {health})")
            return fn(self.client)
        finally:
            with self._lock:
                self._calls -= 1
                self._lock.notify_all()

    def register(self, ptr: int, size: int) -> None:
        """Register memory transfers read or write (needed for rdma); unregistered on close."""
        code = self.call(lambda client: client.register_buffer(ptr, size))
        if code != OK:
            logger.warning("mooncake register_buffer of %d bytes returned %s; transfers are tried anyway", size, code)
        self._buffers.append(ptr)

    def close(self) -> None:
        """Close the client once no call runs (a late one may: then it is abandoned, not closed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._lock.wait_for(lambda: self._calls == 0, self.close_timeout_s):
                logger.warning("mooncake client abandoned, not closed: a store call is still running")
                return
        for ptr in self._buffers:
            self.client.unregister_buffer(ptr)
        self.client.close()
