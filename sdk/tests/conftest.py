"""The SDK's tests need the dummy connector installed (declared in sdk/pyproject.toml, group ``test``)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from kvconn.testing.conformance.waits import WAIT_ENV

#: The wait bound of the suite's runs: a broken connector's stall waits all of it (``kvconn validate``: 10 s).
SUITE_WAIT_S = "2"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(WAIT_ENV, SUITE_WAIT_S)
    try:
        distribution("kvconn-dummy")
    except PackageNotFoundError:
        raise pytest.UsageError(
            "the SDK's tests load the 'dummy' connector by its entry point, and kvconn-dummy is not installed: "
            "run `make install`, or `pip install -e plugins/dummy`"
        ) from None
