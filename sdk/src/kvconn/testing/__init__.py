"""Test kit for connector authors and engines.

Mirrors the utilities vLLM connector authors know (``create_scheduler``,
``create_requests``, ``make_model_runner_output``, ``assert_scheduler_empty``),
and holds the conformance suite (:mod:`kvconn.testing.conformance`).
``ConnectorConformance`` (the pytest base class) is importable from here too;
so is ``StoreConformance`` (the store contract, for store authors);
both are loaded on first access, so that this package does not need pytest.

Read by: connector authors' tests, ``kvconn validate`` (the CLI) and the
engine adapters' test rigs. Public: ``__all__`` below, and the modules
:mod:`.conformance`, :mod:`.store_conformance`, :mod:`.step_contract`,
:mod:`.raw_hook_connector` (the connector written on the raw hooks;
``kvconn.testing.hook_reference`` is its former name) and
:mod:`.memory_connector` (a store connector over an in-memory store). Nothing
that serves imports it (an import-linter contract holds vLLM's serving path to
that). A change here updates the ``kvconn.testing`` layers contract in
``pyproject.toml`` and docs/architecture.md's map.
"""

from __future__ import annotations

from typing import Any

from .conformance import CheckResult, ConformanceFailure, ConnectorReport, list_checks, run_conformance
from .utils import (
    assert_scheduler_empty,
    create_requests,
    create_scheduler,
    make_model_runner_output,
    run_to_completion,
)

__all__ = [
    "CheckResult",
    "ConformanceFailure",
    "ConnectorConformance",
    "ConnectorReport",
    "StoreConformance",
    "assert_scheduler_empty",
    "create_requests",
    "create_scheduler",
    "list_checks",
    "make_model_runner_output",
    "run_conformance",
    "run_to_completion",
]


def __getattr__(name: str) -> Any:
    if name == "ConnectorConformance":
        from .pytest_plugin import ConnectorConformance

        return ConnectorConformance
    if name == "StoreConformance":
        from .store_conformance import StoreConformance

        return StoreConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
