"""pytest plugin (entry point ``pytest11``): fixtures for connector tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ..engine import Engine
from ..engine.request import Request
from ..engine.scheduler import Scheduler
from .utils import create_requests, create_scheduler


@pytest.fixture
def kvconn_scheduler_factory() -> Callable[..., Scheduler]:
    """``create_scheduler`` (``kvconn.testing``) as a fixture."""
    return create_scheduler


@pytest.fixture
def kvconn_request_factory() -> Callable[..., list[Request]]:
    """``create_requests`` (``kvconn.testing``) as a fixture."""
    return create_requests


@pytest.fixture
def kvconn_engine_factory() -> Any:
    """Build reference engines; each is closed at teardown."""
    engines: list[Engine] = []

    def make(*args: Any, **kwargs: Any) -> Engine:
        engine = Engine(*args, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
