"""One connector under test: loaded once, its scenario traces shared by the checks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ...errors import ConnectorConfigError
from ...registry import build_config, connector_roles, load_connector_class
from .catalog import Check
from .driver import DriverFactory, get_driver
from .results import CheckResult, CheckSkipped, ConformanceFailure, Violation
from .scenarios import STANDARD, Scenario, Trace, run_scenario

__all__ = ["Session"]

T = TypeVar("T")

#: The check that reports a connector that does not configure with no config.
CONFIG_DEFAULTS_CHECK = "KV004"

_MISSING = {
    "saves": "the connector does not save (saves = False)",
    "loads": "the connector does not load (loads = False)",
    "scheduler": "the connector does not serve the scheduler role",
    "worker": "the connector does not serve the worker role",
}


class Session:
    """Loads ``connector`` (raising the SDK's load errors) and runs checks against it.

    Scenario traces and other expensive observations are computed on first
    use and shared, so the whole suite costs each scenario once.
    """

    def __init__(self, connector: str, config: Mapping[str, Any] | None = None, driver: str = "reference") -> None:
        self.connector = connector
        self.config = dict(config) if config is not None else None
        self.driver_name = driver
        self.factory: DriverFactory = get_driver(driver)
        self.cls = load_connector_class(connector)
        #: Why the connector does not configure with no config (KV004 reports it; the other checks skip).
        self.config_error: str | None = None
        try:
            build_config(self.cls, self.config, name=connector)
        except ConnectorConfigError as exc:
            if self.config is not None:
                raise
            self.config_error = str(exc)
        roles = connector_roles(self.cls)
        self.capabilities = frozenset(
            {r.value for r in roles}
            | ({"saves"} if getattr(self.cls, "saves", False) else set())
            | ({"loads"} if getattr(self.cls, "loads", False) else set())
        )
        self._memo: dict[str, Any] = {}

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per session under ``key``."""
        if key not in self._memo:
            self._memo[key] = compute()
        value: T = self._memo[key]
        return value

    def _play(self, scenario: Scenario) -> Trace:
        return self.memo(
            f"trace:{scenario.name}", lambda: run_scenario(self.factory, scenario, self.connector, self.config)
        )

    def trace(self, scenario: Scenario) -> Trace:
        """The (cached) trace of ``scenario``; skips the calling check if the driver cannot run it."""
        trace = self._play(scenario)
        if trace.unsupported:
            raise CheckSkipped(
                f"the {self.driver_name} driver cannot run scenario {scenario.name!r}: {trace.unsupported}"
            )
        return trace

    def standard_traces(self) -> list[Trace]:
        """Traces of the standard scenarios this driver can run (some drivers cannot run them all)."""
        traces = [t for t in map(self._play, STANDARD) if not t.unsupported]
        if not traces:
            raise CheckSkipped(f"the {self.driver_name} driver can run none of the standard scenarios")
        return traces

    def completed_traces(self) -> list[Trace]:
        """The standard traces; a scenario the connector broke fails the calling check with its error."""
        traces = self.standard_traces()
        for trace in traces:
            if trace.error:
                raise Violation(f"the connector raised in {trace.error}")
        return traces

    def run(self, check: Check) -> CheckResult:
        """Run one check; never raises (an unexpected exception is a failure)."""
        if self.config_error is not None and check.id != CONFIG_DEFAULTS_CHECK:
            return CheckResult(
                check.id,
                check.name,
                "skipped",
                f"the connector does not load with no config ({CONFIG_DEFAULTS_CHECK}); pass one to run this check",
            )
        missing = sorted(check.requires - self.capabilities)
        if missing:
            return CheckResult(check.id, check.name, "skipped", "; ".join(_MISSING[m] for m in missing))
        try:
            check.function(self)
        except ConformanceFailure as exc:
            return CheckResult(check.id, check.name, "failed", str(exc))
        except Violation as exc:
            return CheckResult(check.id, check.name, "failed", str(ConformanceFailure(str(exc), check.fix)))
        except CheckSkipped as exc:
            return CheckResult(check.id, check.name, "skipped", str(exc))
        except Exception as exc:
            return CheckResult(check.id, check.name, "failed", f"{type(exc).__name__}: {exc}")
        return CheckResult(check.id, check.name, "passed")
