"""The SDK's tests need the dummy connector installed (declared in sdk/pyproject.toml, group ``test``)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, distribution

import pytest

from kvconn.testing.conformance.waits import WAIT_ENV

#: The wait bound of the suite's runs: a broken connector's stall waits all of it (``kvconn validate``: 10 s).
#: Under 1.98 s, the least time the host's 128 idle steps (``stall_steps``) take (32 sleeps of 2 ms, then 20 ms),
#: so a scenario's stall is reported before the host degrades the connector, whatever the machine's load (the
#: conformance drivers' hosts bound stalls by those steps alone: ``stall_s=0``).
SUITE_WAIT_S = "1"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(WAIT_ENV, SUITE_WAIT_S)
    try:
        distribution("kvconn-dummy")
    except PackageNotFoundError:
        raise pytest.UsageError(
            "the SDK's tests load the 'dummy' connector by its entry point, and kvconn-dummy is not installed: "
            "run `make install`, or `pip install -e plugins/dummy`"
        ) from None
