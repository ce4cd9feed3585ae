"""The real backend: ``mooncake.store.MooncakeDistributedStore`` behind :class:`Store`.

What this wrapper adds to the client, each from an observed behaviour:

* ``setup`` blocks ~90 s when the master is down, so connecting first probes
  the master's port and then runs ``setup`` in a thread with a timeout. A
  failed connect leaves the store *disconnected* (every call fails fast with
  ``RPC_FAIL``) and is retried at most every ``retry_interval_s``.
* With the master gone, each call blocks ~4.3 s before failing. The client's
  ``health_check()`` (microseconds) turns non-zero within a second of the
  master going away and back to ``0`` once the client has reconnected and
  re-mounted its segment, so every call is gated on it: while the master is
  down, calls fail fast; when it returns, the same client resumes by itself.
* Any call after ``close()`` crashes the process, so ``close`` is idempotent
  and every later call fails fast instead of reaching the client.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .codes import OK, RPC_FAIL
from .config import RealStoreSettings

__all__ = ["MooncakeStore", "import_client"]

logger = logging.getLogger("kvconn_mooncake")

_PROBE_TIMEOUT_S = 1.0


def import_client() -> Callable[[], Any]:
    """The client class; ``ImportError`` with the fix when the wheel is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"the real Mooncake store needs its client: pip install 'kvconn-mooncake[store]' "
            f"(mooncake-transfer-engine-non-cuda; Debian needs libibverbs1 librdmacm1): {exc}"
        ) from exc
    return MooncakeDistributedStore


class MooncakeStore:
    """A :class:`~kvconn_mooncake.store.Store` over one Mooncake client."""

    def __init__(self, settings: RealStoreSettings, client_factory: Callable[[], Any] | None = None) -> None:
        self.settings = settings
        self._factory = client_factory or import_client()
        self._client: Any = None
        self._closed = False
        self._healthy = False
        self._next_connect = 0.0
        self._buffers: list[tuple[int, int]] = []
        self._connect()

    # ------------------------------------------------------------ connection

    def _master_reachable(self) -> bool:
        try:
            socket.create_connection(self.settings.master_host_port, timeout=_PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True

    def _connect(self) -> bool:
        s = self.settings
        self._next_connect = time.monotonic() + s.retry_interval_s
        if not self._master_reachable():
            logger.warning(
                "mooncake master %s is not reachable: the store is off (no saves, no hits); retrying every %.0f s",
                s.master_server_address, s.retry_interval_s,
            )  # fmt: skip
            return False
        client = self._factory()
        result: list[int] = []
        args = (
            s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
            s.protocol, s.rdma_devices, s.master_server_address,
        )  # fmt: skip
        thread = threading.Thread(target=lambda: result.append(client.setup(*args)), daemon=True)
        thread.start()
        thread.join(s.setup_timeout_s)
        if not result or result[0] != OK:
            why = f"returned {result[0]}" if result else f"did not finish within {s.setup_timeout_s} s"
            logger.warning(
                "mooncake client setup with master %s %s: the store is off; retrying every %.0f s",
                s.master_server_address, why, s.retry_interval_s,
            )  # fmt: skip
            return False  # a client whose setup failed or hangs is abandoned, never closed or reused
        self._client = client
        self._healthy = True
        for ptr, size in self._buffers:
            client.register_buffer(ptr, size)
        logger.info("mooncake client connected to master %s", s.master_server_address)
        return True

    def _ready(self) -> bool:
        """Whether a call may reach the client now (never after close; not while the master is away)."""
        if self._closed:
            return False
        if self._client is None and (time.monotonic() < self._next_connect or not self._connect()):
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

    # ---------------------------------------------------------------- Store

    def register_buffer(self, ptr: int, size: int) -> int:
        self._buffers.append((ptr, size))
        if self._closed or self._client is None:
            return OK  # registered on connect
        return int(self._client.register_buffer(ptr, size))

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        if not keys:
            return []
        if not self._ready():
            return [RPC_FAIL] * len(keys)
        return list(self._client.batch_is_exist(list(keys)))

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
        if not keys:
            return []
        if not self._ready():
            return [RPC_FAIL] * len(keys)
        if all(len(p) == 1 for p in ptrs):
            return list(getattr(self._client, call)(keys, [p[0] for p in ptrs], [s[0] for s in sizes]))
        # The client converts any sequences itself: copying 256 part lists here would cost more than building them.
        return list(getattr(self._client, f"{call}_multi_buffers")(keys, ptrs, sizes))

    def close(self) -> None:
        """Close the client once; every later call fails fast (a call after close would crash)."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            for ptr, _ in self._buffers:
                self._client.unregister_buffer(ptr)
            self._client.close()
            self._client = None
