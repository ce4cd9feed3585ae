"""The Redis store against the store contract, on a real redis-server."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
import redis
from redis_server import RedisServer

from kvconn.store import BlockStore
from kvconn.testing.store_conformance import StoreConformance
from kvconn_redis import RedisStore


class TestRedisStore(StoreConformance):
    @pytest.fixture(autouse=True)
    def _server(self) -> Iterator[None]:
        self.server = RedisServer().start()
        yield
        self.server.stop()

    def make_store(self) -> BlockStore:
        return RedisStore(redis.Redis(port=self.server.port, socket_timeout=1.0, socket_connect_timeout=1.0))

    def make_unreachable(self, store: BlockStore) -> None:
        self.server.signal(signal.SIGSTOP)  # a stalled server: calls must time out and raise
