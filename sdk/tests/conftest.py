"""The SDK's tests need the dummy connector installed (declared in sdk/pyproject.toml, group ``test``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        distribution("kvconn-dummy")
    except PackageNotFoundError:
        raise pytest.UsageError(
            "the SDK's tests load the 'dummy' connector by its entry point, and kvconn-dummy is not installed: "
            "run `make install`, or `pip install -e plugins/dummy`"
        ) from None
