from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from redis_server import RedisServer, require_redis_server


@pytest.fixture
def server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _redis_installed() -> None:
    """Every test here runs a real redis-server."""
    require_redis_server()
