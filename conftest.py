"""Repository-wide pytest configuration."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvconn.testing import hook_reference, memory_store

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
    hook_reference.STORE.clear()
    memory_store.clear()
    yield
    hook_reference.STORE.clear()
    memory_store.clear()
