"""The real backend behind the store layer's guard, against a stand-in client (no master, no root).

The stand-in client blocks where a wedged master makes the real one block
(until the test releases it), and a local listener answers the pre-flight
probe as a master would. Deadlines, trip and recover are the guard's
(kvconn.store); connecting, health and closing are the plugin's. The real-store tests repeat this against
``mooncake_master`` (``test_real_store.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvconn.store import PartsStore, StoreGuard, StoreUnavailable
from kvconn_mooncake.codes import OK
from kvconn_mooncake.config import RealStoreSettings
from kvconn_mooncake.mooncake_store import probe_master
from kvconn_mooncake.store import open_real


class StandInClient:
    """Answers like ``MooncakeDistributedStore``; ``batch_is_exist`` blocks while ``wedged`` is set."""

    def __init__(self) -> None:
        self.wedged = threading.Event()
        self.released = threading.Event()
        self.calls: list[str] = []
        self.closed = False

    def setup(self, *args: object) -> int:
        return OK

    def health_check(self) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        self.calls.append("register_buffer")
        return OK

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.calls.append("batch_is_exist")
        if self.wedged.is_set():
            self.released.wait(30)
        return [0] * len(keys)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return [OK] * len(keys)

    def unregister_buffer(self, ptr: int) -> int:
        return OK

    def close(self) -> int:
        assert not self.closed, "closed twice"
        self.closed = True
        return OK


@contextlib.contextmanager
def listener(answer: bytes, server: socket.socket | None = None) -> Iterator[str]:
    """A local TCP server that sends ``answer`` to each connection (nothing when empty); yields ``host:port``.

    ``server``: a socket bound but not listening yet (connects to it are refused until now).
    """
    if server is None:
        server = socket.create_server(("127.0.0.1", 0))
    else:
        server.listen()
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                held.append(conn)
                if answer:
                    conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()
        for conn in held:
            conn.close()


MASTER_ANSWER = bytes([21]) + bytes(15)  # a coro_rpc response header: what a master sends back to the probe


def _settings(master: str) -> RealStoreSettings:
    return RealStoreSettings(
        master_server_address=master, metadata_server="http://127.0.0.1:1/metadata", protocol="tcp",
        local_hostname="127.0.0.1", rdma_devices="", global_segment_size=16 << 20, local_buffer_size=0,
        setup_timeout_s=2.0,
    )  # fmt: skip


def _guard(settings: RealStoreSettings, client: StandInClient) -> StoreGuard:
    """The store as a store connector's side holds it: opened lazily, on the guard's threads, within deadlines."""
    open_store = lambda: open_real(settings, lambda: client, close_timeout_s=0.5)  # noqa: E731
    return StoreGuard("mooncake", open_store, timeout_s=0.2, retry_interval_s=0.05, max_backoff_s=0.1)


def _opened(guard: StoreGuard) -> StoreGuard:
    """``guard`` once its store is open (connecting is not what these tests time: a loaded machine may be slow)."""
    guard.result("open", guard.submit("open", lambda store: store), timeout=20.0)
    return guard


def _contains(guard: StoreGuard, keys: Sequence[bytes] = (b"a",)) -> list[bool]:
    return guard.call("contains", lambda store: list(store.contains(keys)))


def _answers(guard: StoreGuard) -> bool:
    try:
        return _contains(guard) == [False]
    except StoreUnavailable:
        return False


def _eventually(condition: Callable[[], bool], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_call_past_its_deadline_degrades_fails_fast_and_recovers() -> None:
    client = StandInClient()
    with listener(MASTER_ANSWER) as master:
        guard = _opened(_guard(_settings(master), client))
        assert _contains(guard) == [False] and client.calls == ["batch_is_exist"]
        client.wedged.set()
        with pytest.raises(StoreUnavailable):
            _contains(guard, [b"a", b"b"])  # past the deadline: degraded
        with pytest.raises(StoreUnavailable):
            _contains(guard)  # tripped: fails fast, the client is not called
        assert client.calls.count("batch_is_exist") == 2
        client.wedged.clear()
        client.released.set()  # the late call returns; the background probe then finds the store in time
        assert _eventually(lambda: _answers(guard))
        guard.close()
        assert client.closed
        with pytest.raises(StoreUnavailable):
            _contains(guard)  # never a call after close


@pytest.mark.parametrize(("answer", "problem"), [(b"", "no answer within"), (b"HTTP/1.1 400", "not a Mooncake master")])
def test_an_address_that_is_not_a_master_leaves_the_store_off(answer: bytes, problem: str) -> None:
    client = StandInClient()
    with listener(answer) as address:
        reason = probe_master(*_settings(address).master_host_port, 0.2)
        assert reason is not None and problem in reason
        settings = dataclasses.replace(_settings(address), setup_timeout_s=0.1)
        with pytest.raises(ConnectionError, match=problem):
            open_real(settings, lambda: client, close_timeout_s=0.5)
        guard = _guard(settings, client)
        with pytest.raises(StoreUnavailable):
            _contains(guard)
        assert client.calls == [] and guard.trips == 1  # setup was never attempted; the store is off
        guard.close()


def test_a_store_started_before_its_master_connects_within_an_interval_of_it_coming_up() -> None:
    """A refused connect ends at once, and the guard's probe connects again within its backoff of the master.

    The master's port is bound but not listening while the store starts (connects are refused, as with
    no master yet), then listens and answers; setup_timeout_s (60 s here) is never waited out.
    """
    client = StandInClient()
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    guard = _guard(dataclasses.replace(_settings(address), setup_timeout_s=60.0), client)
    with pytest.raises(StoreUnavailable):
        _contains(guard)  # off: nothing listens yet
    with listener(MASTER_ANSWER, port):
        up = time.monotonic()
        assert _eventually(lambda: _answers(guard))
        print(f"first answer {time.monotonic() - up:.2f} s after the master came up (max_backoff_s 0.1)")
    guard.close()


def test_a_warm_up_that_fails_leaves_the_store_working(caplog: pytest.LogCaptureFixture) -> None:
    """``warm_segment`` is best effort: a client that cannot do it (this stand-in has no ``get_hostname``) connects."""
    client = StandInClient()
    with listener(MASTER_ANSWER) as address:
        guard = _guard(dataclasses.replace(_settings(address), warm_segment=True), client)
        assert _eventually(lambda: _answers(guard))
    guard.close()
    assert "mooncake segment warm-up failed" in caplog.text and "get_hostname" in caplog.text


def test_a_client_with_a_call_still_running_is_abandoned_not_closed() -> None:
    """Any call after ``close()`` crashes the real client: a late call keeps it from being closed under it."""
    client = StandInClient()
    with listener(MASTER_ANSWER) as master:
        guard = _opened(_guard(_settings(master), client))
        assert _contains(guard) == [False]
        client.wedged.set()
        with pytest.raises(StoreUnavailable):
            _contains(guard)
        guard.close()  # waits close_timeout_s for the late call, then abandons the client
        assert not client.closed
        client.released.set()


def test_over_rdma_saves_are_staged_and_their_buffers_registered() -> None:
    """In-place saves would hand rdma unregistered KV-cache memory: over rdma the store offers no put_parts."""
    client = StandInClient()
    with listener(MASTER_ANSWER) as master:
        tcp = open_real(_settings(master), StandInClient, close_timeout_s=0.5)
        rdma = open_real(dataclasses.replace(_settings(master), protocol="rdma"), lambda: client, close_timeout_s=0.5)
        assert isinstance(tcp, PartsStore) and not isinstance(rdma, PartsStore)
        buffer = bytearray(64)
        assert rdma.put([b"k"], [memoryview(buffer)]) == rdma.put([b"k"], [memoryview(buffer)[:32]]) == [True]
        assert client.calls.count("register_buffer") == 1  # once per buffer, whatever view of it a call uses
        tcp.close()
        rdma.close()
