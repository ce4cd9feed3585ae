"""The real backend's deadlines and recovery, against a stand-in client (no master, no root).

The stand-in client blocks where a wedged master makes the real one block
(until the test releases it), and a local listener answers the pre-flight
probe as a master would. The real-store tests repeat this against
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

from kvconn_mooncake.codes import OK, RPC_FAIL
from kvconn_mooncake.config import RealStoreSettings
from kvconn_mooncake.mooncake_store import MooncakeStore, probe_master


class StandInClient:
    """Answers like ``MooncakeDistributedStore``; ``batch_is_exist`` blocks while ``wedged`` is set."""

    def __init__(self) -> None:
        self.wedged = threading.Event()
        self.released = threading.Event()
        self.calls: list[str] = []

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

    def unregister_buffer(self, ptr: int) -> int:
        return OK

    def close(self) -> int:
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
        setup_timeout_s=2.0, retry_interval_s=0.05, store_timeout_s=0.2, max_backoff_s=0.1,
    )  # fmt: skip


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
        store = MooncakeStore(_settings(master), lambda: client)
        store.register_buffer(1 << 20, 4096)
        assert store.batch_is_exist(["a"]) == [0] and client.calls == ["register_buffer", "batch_is_exist"]
        client.wedged.set()
        assert store.batch_is_exist(["a", "b"]) == [RPC_FAIL, RPC_FAIL]  # past the deadline: degraded
        assert store.batch_is_exist(["a"]) == [RPC_FAIL]  # tripped: fails fast, the client is not called
        assert client.calls.count("batch_is_exist") == 2
        client.wedged.clear()
        client.released.set()  # the late call returns; the background probe then finds the store in time
        assert _eventually(lambda: store.batch_is_exist(["a"]) == [0])
        store.close()
        assert store.batch_is_exist(["a"]) == [RPC_FAIL]  # never a call after close


@pytest.mark.parametrize(("answer", "problem"), [(b"", "no answer within"), (b"HTTP/1.1 400", "not a Mooncake master")])
def test_an_address_that_is_not_a_master_leaves_the_store_off(answer: bytes, problem: str) -> None:
    client = StandInClient()
    with listener(answer) as address:
        reason = probe_master(*_settings(address).master_host_port, 0.2)
        assert reason is not None and problem in reason
        store = MooncakeStore(dataclasses.replace(_settings(address), setup_timeout_s=0.3), lambda: client)
        assert store.batch_is_exist(["a"]) == [RPC_FAIL] and client.calls == []  # setup was never attempted
        store.close()


def test_a_store_started_before_its_master_connects_within_an_interval_of_it_coming_up() -> None:
    """A refused connect ends at once: the next one is due retry_interval_s later, not after setup_timeout_s.

    The master's port is bound but not listening while the store starts (connects are refused, as with
    no master yet), then listens and answers. Before the fix the retry waited out the first attempt's
    setup_timeout_s (60 s here) plus the interval; the 20 s wait below is far from both.
    """
    client = StandInClient()
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    store = MooncakeStore(dataclasses.replace(_settings(address), setup_timeout_s=60.0), lambda: client)
    assert store.batch_is_exist(["a"]) == [RPC_FAIL]  # off: nothing listens yet
    with listener(MASTER_ANSWER, port):
        up = time.monotonic()
        assert _eventually(lambda: store.batch_is_exist(["a"]) == [0])
        print(f"first answer {time.monotonic() - up:.2f} s after the master came up (retry_interval_s 0.05)")
    store.close()


def test_closing_a_store_ends_its_caller_thread() -> None:
    """One thread per store: `kvconn validate --config-factory` and engine restarts would otherwise pile them up."""
    with listener(MASTER_ANSWER) as master:
        store = MooncakeStore(_settings(master), StandInClient)
        assert store.batch_is_exist(["a"]) == [0] and store._caller.thread.is_alive()
        store.close()
    store._caller.thread.join(timeout=20)
    assert not store._caller.thread.is_alive()
