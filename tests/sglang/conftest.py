"""The SGLang tier (.venv-sglang, `make test-sglang`): kvconn stores as SGLang's HiCache L3, through SGLang's code.

Real components only: SGLang's pools, factory and HiCacheController (``kvconn_sglang.testing.rig``), a real
redis-server on 127.0.0.1 (the redis plugin's test helper, stopped by PID), Mooncake's embedded store. The one
stand-in is ``standin/torchvision`` (docs/sglang.md, "The test tier").
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
for path in (HERE / "standin", HERE, REPO / "plugins" / "redis" / "tests", REPO / "plugins" / "mooncake" / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from redis_server import RedisServer, require_redis_server  # noqa: E402

from kvconn_sglang.testing.rig import init_sglang  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _sglang_world() -> None:
    init_sglang()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    require_redis_server()
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    """A namespace per test: stores are shared (the embedded one lives as long as the process)."""
    return f"t-{uuid.uuid4().hex}"


@pytest.fixture(params=["mooncake", "redis"])
def store(request: pytest.FixtureRequest, namespace: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each store the tier is tested with: (connector name, its config)."""
    if request.param == "mooncake":
        yield "mooncake", {"namespace": namespace}
        return
    require_redis_server()
    server = RedisServer().start()
    yield "redis", {"namespace": namespace, "url": server.url, "timeout_s": 1.0, "retry_interval_s": 60.0}
    server.stop()
