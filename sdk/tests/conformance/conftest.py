"""Make the connectors under ``fixtures/`` importable as ``kvconn_conformance_fixtures.<module>:<Class>``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))


@pytest.fixture(autouse=True)
def _empty_store() -> Iterator[None]:
    """Each test starts with an empty shared store: a broken connector's saves must not leak into the next test."""
    from kvconn_conformance_fixtures.store import STORE

    STORE.clear()
    yield
    STORE.clear()
