"""The Redis store against the store contract, on a real redis-server."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
from redis_server import RedisServer

from kvconn.store import BlockStore
from kvconn.testing.store_conformance import StoreConformance
from kvconn_redis import RedisConfig, RedisStore, client


class TestRedisStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _server(self) -> Iterator[None]:
        self.server = RedisServer().start()
        yield
        self.server.stop()

    def make_store(self) -> BlockStore:
        return RedisStore(client(self.server.url, RedisConfig().socket_timeout_s))  # as the connector opens it

    def make_unreachable(self, store: BlockStore) -> None:
        self.server.signal(signal.SIGSTOP)  # a stalled server: calls must time out and raise


MIB = 1 << 20


def _values(n: int) -> list[bytes]:
    return [random.randbytes(MIB) for _ in range(n)]


def _parts(value: bytes) -> list[memoryview]:
    """``value`` as the worker hands it over: a 64-byte header, then a view per layer."""
    view = memoryview(bytearray(value))
    return [view[:64], *(view[i : i + MIB // 4] for i in range(64, len(value), MIB // 4))]


def _read(store: RedisStore, keys: list[bytes]) -> list[bytes | None]:
    buffers = [bytearray(MIB) for _ in keys]
    lengths = store.get(keys, [memoryview(b) for b in buffers])
    return [bytes(b) if n == MIB else None for n, b in zip(lengths, buffers, strict=True)]


@pytest.mark.parametrize("call", ["put", "put_parts"])
def test_a_full_server_refuses_keys_and_stores_the_rest(server: RedisServer, call: str) -> None:
    """Under maxmemory (no eviction) a SET past the limit gets an OOM error reply: that key's refusal."""
    client = server.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 4 * MIB)
    store = RedisStore(server.client())
    keys, values = [b"full/%d" % i for i in range(12)], _values(12)
    answers = store.put(keys, values) if call == "put" else store.put_parts(keys, [_parts(v) for v in values])
    n = answers.count(True)
    assert 0 < n < len(keys) and answers == [True] * n + [False] * (len(keys) - n), answers
    assert _read(store, keys) == values[:n] + [None] * (len(keys) - n), "each key holds its value or nothing"


def test_a_server_killed_mid_batch_raises_and_the_pool_works_after_restart(server: RedisServer) -> None:
    store = RedisStore(redis.Redis(port=server.port, socket_timeout=5.0, socket_connect_timeout=5.0))
    keys, values = [b"killed/%d" % i for i in range(32)], _values(32)  # more than the socket buffers hold
    store.put(keys[:1], values[:1])  # the pool holds a connection from now on
    server.signal(signal.SIGSTOP)
    outcome: list[object] = []
    batch = threading.Thread(target=lambda: outcome.append(_outcome(store, keys, values)))
    batch.start()
    time.sleep(0.5)
    assert batch.is_alive(), "the batch must still be sending when the server goes"
    server.stop()
    batch.join(30)
    assert outcome and isinstance(outcome[0], redis.ConnectionError), outcome
    server.start()
    assert store.put_parts(keys, [_parts(v) for v in values]) == [True] * len(keys)
    assert _read(store, keys) == values and store.contains(keys) == [True] * len(keys)


def _outcome(store: RedisStore, keys: list[bytes], values: list[bytes]) -> object:
    try:
        return store.put_parts(keys, [_parts(v) for v in values])
    except Exception as exc:
        return exc
