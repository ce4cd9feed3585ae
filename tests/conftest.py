"""Shared fixtures for the cross-package tests, and the guard of the tiers that run in venvs of their own."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvconn
from kvconn.testing.conformance.waits import WAIT_ENV


def pytest_configure(config: pytest.Config) -> None:
    """The suite's wait bound, as sdk/tests/conftest.py's ``SUITE_WAIT_S`` says why (``kvconn validate``: 10 s)."""
    os.environ.setdefault(WAIT_ENV, "1")


REDIS_SERVER = Path(__file__).parent.parent / "plugins" / "redis" / "tests" / "redis_server.py"


def installed(*names: str) -> list[str]:
    """The given connector names that are installed here (plugins may be absent in a partial checkout)."""
    available = kvconn.available_connectors()
    return [n for n in names if n in available]


def guard_tier(
    here: Path, problem: str | None, *, needs: str, fix: str
) -> Callable[[pytest.Config, list[pytest.Item]], None]:
    """The ``pytest_collection_modifyitems`` of a tier (the directory ``here``) that needs ``needs`` (vLLM).

    ``problem`` says why this environment cannot run the tier (``None``: it can).
    The tier's tests are then skipped with that reason, except under ``CI=true``,
    where this raises at once, saying how to run it (``fix``): CI must run every tier.
    """
    if problem and os.environ.get("CI") == "true":
        raise RuntimeError(f"CI=true but {needs} is not usable here ({problem}): {fix}")

    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        if problem:
            skip = pytest.mark.skip(reason=f"{needs} is not usable in this environment: {problem}")
            for item in items:
                if here in Path(item.path).parents:
                    item.add_marker(skip)

    return pytest_collection_modifyitems


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A real redis-server on 127.0.0.1 (the Redis plugin's test harness), stopped by PID afterwards."""
    spec = importlib.util.spec_from_file_location("redis_server", REDIS_SERVER)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.require_redis_server()
    server = module.RedisServer().start()
    yield server
    server.stop()
