"""pytest plugin (entry point ``pytest11``): fixtures for connector tests, and
``ConnectorConformance``, the one-line way to run the conformance suite::

    from kvconn.testing import ConnectorConformance

    class TestMine(ConnectorConformance):
        connector = "mine"            # or "pkg.module:Class"
        config = {"capacity": 64}     # optional

Every check becomes one test, ``test_conformance[KV011-block-fill]``: a failing
check fails with what was observed and how to fix it; a check that does not
apply to the connector is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from ..reference import Engine
from ..reference.request import Request
from ..reference.scheduler import Scheduler
from .conformance import Check, Session, list_checks
from .conformance.runner import open_session
from .utils import create_requests, create_scheduler

__all__ = ["ConnectorConformance"]


@pytest.fixture
def kvconn_scheduler_factory() -> Callable[..., Scheduler]:
    """``create_scheduler`` (``kvconn.testing``) as a fixture."""
    return create_scheduler


@pytest.fixture
def kvconn_request_factory() -> Callable[..., list[Request]]:
    """``create_requests`` (``kvconn.testing``) as a fixture."""
    return create_requests


@pytest.fixture
def kvconn_engine_factory() -> Iterator[Callable[..., Engine]]:
    """Build reference engines; each is closed at teardown."""
    engines: list[Engine] = []

    def make(*args: Any, **kwargs: Any) -> Engine:
        engine = Engine(*args, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


_CHECKS = list_checks()
# One session per test class: the connector loads once and scenarios run once.
_SESSIONS: dict[type, Session | str] = {}


class ConnectorConformance:
    """Subclass with ``connector = "name"`` to get every conformance check as a test.

    ``config`` is the connector's config (its defaults when ``None``);
    ``driver`` names the scheduler driver (``"reference"``). A connector whose
    store persists declares ``fresh_store_config`` and every run gets a fresh
    store; override :meth:`config_factory` to choose each scenario's and data
    run's config here instead. The run directories are removed when the
    class's tests end.
    """

    connector: ClassVar[str]
    config: ClassVar[Mapping[str, Any] | None] = None
    driver: ClassVar[str] = "reference"

    def config_factory(self, run: str, directory: Path) -> Mapping[str, Any] | None:
        """The config for the scenario or data run named ``run`` (called once per run): ``config`` by default.

        Every run already gets new connector instances; a store that outlives
        them (files, a server) must not carry blocks from one run into the
        next (KV045), so return a fresh store for each ``run``: a namespace,
        or files under ``directory`` (empty, the run's own, removed with the
        session, as pytest's ``tmp_path``). An override taking ``run`` alone
        still works.
        """
        return type(self).config

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _kvconn_close_session(cls) -> Iterator[None]:
        """Close the class's session after its last test: its run directories go with it."""
        yield
        session = _SESSIONS.pop(cls, None)
        if isinstance(session, Session):
            session.close()

    @pytest.mark.parametrize("kvconn_check", _CHECKS, ids=[f"{c.id}-{c.name}" for c in _CHECKS])
    def test_conformance(self, kvconn_check: Check) -> None:
        cls = type(self)
        name = getattr(cls, "connector", None)
        if not isinstance(name, str) or not name:
            pytest.fail(f'{cls.__name__} must set connector = "name" (or "pkg.module:Class")', pytrace=False)
        if cls not in _SESSIONS:
            overridden = cls.config_factory is not ConnectorConformance.config_factory
            _SESSIONS[cls] = open_session(name, cls.config, cls.driver, self.config_factory if overridden else None)
        session = _SESSIONS[cls]
        if isinstance(session, str):
            pytest.fail(f"connector {name!r} did not load: {session}", pytrace=False)
        result = session.run(kvconn_check)
        if result.status == "skipped":
            pytest.skip(result.message)
        if result.status == "failed":
            pytest.fail(f"{result.id} {result.name}: {result.message}", pytrace=False)
