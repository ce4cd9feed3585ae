"""Repository-wide pytest configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvconn.testing import memory_store, raw_hook_connector

try:
    from hypothesis import settings
except ImportError:  # the vLLM tier's venv has no hypothesis (and no property tests)
    settings = None

if settings is not None:
    # CI replays the same examples every run (a flaky red build helps nobody); locally, hypothesis explores.
    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


@pytest.fixture(autouse=True)
def empty_memory_store() -> Iterator[None]:
    """Every test starts and ends with empty in-process stores (the memory connectors') and no store faults."""
    raw_hook_connector.STORE.clear()
    memory_store.clear()
    yield
    raw_hook_connector.STORE.clear()
    memory_store.clear()
