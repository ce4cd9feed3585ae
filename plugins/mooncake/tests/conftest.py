"""Fixtures of the mooncake plugin's tests.

Helper modules beside the tests are loaded by path: the workspace runs pytest
with ``--import-mode=importlib``, where test directories are not importable.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import types
import uuid
from typing import Any

import pytest


def load_sibling(name: str) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def scenarios() -> types.ModuleType:
    return load_sibling("scenarios")


@pytest.fixture(scope="session")
def harness() -> types.ModuleType:
    return load_sibling("mooncake_netns")


@pytest.fixture(scope="session")
def real_store(harness: types.ModuleType) -> types.ModuleType:
    """The netns harness, when a real master can run here; else skip (fail under CI=true).

    CI runs as root on Debian with the ``store`` extra installed: a skip there
    would hide that the real-store tier did not run.
    """
    reason = harness.netns_unavailable_reason() or harness.mooncake_unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"real Mooncake store tests cannot run under CI: {reason}")
        pytest.skip(reason)
    return harness


@pytest.fixture
def embedded_config() -> dict[str, Any]:
    """Config of the embedded backend on a store no other test shares."""
    return {"backend": "embedded", "embedded_store": f"test-{uuid.uuid4().hex}"}
