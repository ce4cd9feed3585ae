"""One connector under test: loaded once, its scenario traces shared by the checks."""

from __future__ import annotations

import inspect
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from ..._plugins.registry import build_config, connector_roles, load_connector_class
from ...connector import KVConnector
from ...errors import BlockStateSerializationError, ConnectorConfigError, ConnectorError, WireError
from ...host import BadHookAnswer
from ...store import StoreConnector
from .catalog import Check, get_check
from .driver import DriverFactory
from .driver_registry import get_driver
from .request_ids import RequestTags
from .results import NOT_RUN, CheckResult, CheckSkipped, ConformanceFailure, ScenarioBroken
from .scenarios import STANDARD, Scenario, Trace, run_scenario

__all__ = ["ConfigFactory", "Session"]

T = TypeVar("T")

#: The check that reports a connector that does not configure with no config.
CONFIG_DEFAULTS_CHECK = "KV004"
#: Called with the name of each scenario or data run, and (when it takes a second argument) a directory of that
#: run's own that the suite removes afterwards; returns the connector's config for that run.
ConfigFactory = Callable[..., Mapping[str, Any] | None]

METADATA_FIX = (
    "build metadata from plain data only, as an instance of your Metadata class (a KVConnectorMetadata Struct): "
    "resolve tables with block_state.get_block_ids(req_id) into lists of ints; never store the block state, "
    "a resolver, a request or the scheduler output"
)


ANSWER_FIX = (
    "answer each hook as its docstring in kvconn.hookspecs says: the host checks every per-step answer and "
    "degrades a connector whose answer breaks the contract (the error names the hook and the value)"
)


def _fix_for(exc: BaseException | None) -> str | None:
    """A fix more precise than the check's own, when the error says what is wrong.

    Metadata that cannot travel, or an answer the host refused (``BadHookAnswer``:
    e.g. a sync load reported in ``finished_recving``, which the host catches
    before any check of the run can).
    """
    if isinstance(exc, ConnectorError) and isinstance(exc.__cause__, BadHookAnswer):
        return ANSWER_FIX
    if isinstance(exc, (WireError, BlockStateSerializationError)) or (
        isinstance(exc, ConnectorError) and isinstance(exc.__cause__, TypeError) and "not an instance" in str(exc)
    ):
        return METADATA_FIX
    return None


_MISSING = {
    "saves": "the connector does not save (saves = False)",
    "loads": "the connector does not load (loads = False)",
    "scheduler": "the connector does not serve the scheduler role",
    "worker": "the connector does not serve the worker role",
    "store": "not a kvconn.store connector (StoreConnector): no store of its own to hold to the store contract",
}


class Session:
    """Loads ``connector`` (raising the SDK's load errors) and runs checks against it.

    Scenario traces, data runs, their baselines (the tokens without the
    connector) and other expensive observations are computed on first use and
    shared (:meth:`memo`), so the whole suite costs each run once. Each check's
    result is kept too: a check runs after the checks it depends on, and is
    not run (skipped, ``"not run: ..."``) when one of them failed, so a root
    cause is reported once. The first check to meet a connector error in a
    scenario reports it; later checks meeting one are not run.

    ``config_factory``, when given, is called with each scenario's (or data
    run's) name (and a directory of the run's own, when it takes two
    arguments) for that run's config: a connector with a persistent store
    gets a fresh namespace for every run. Without one, the connector's own
    ``fresh_store_config`` (laid over ``config``) serves, when it declares one.
    ``config`` serves everything else. The run directories live in one
    temporary directory that :meth:`close` removes.

    Every run gives the engine request ids of its own (``tags``: see
    :mod:`.request_ids`); each result names requests as the scenarios do.
    """

    #: Whether every data run must load something (a kvconn plugin that saves and loads reuses any shared full
    #: block); a vLLM connector may reuse only whole prompts (``ExampleConnector``), so its runs that claim
    #: nothing are judged on their tokens alone, and a round trip must still load.
    every_data_run_loads = True
    #: Holds the run directories, made on the first one (a class default: subclasses need not set it).
    _workdir: tempfile.TemporaryDirectory[str] | None = None

    def __init__(
        self,
        connector: str,
        config: Mapping[str, Any] | None = None,
        driver: str = "reference",
        config_factory: ConfigFactory | None = None,
    ) -> None:
        self.connector = connector
        self.config = dict(config) if config is not None else None
        self.driver_name = driver
        self.factory: DriverFactory = get_driver(driver)
        self.cls = load_connector_class(connector)
        self.config_factory = config_factory if config_factory is not None else self._declared_factory()
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
            | ({"store"} if isinstance(self.cls, type) and issubclass(self.cls, StoreConnector) else set())
        )
        self._start()

    def _start(self) -> None:
        """What a session keeps while its checks run, empty (a subclass that sets itself up calls it too)."""
        self.tags = RequestTags()
        self._memo: dict[str, Any] = {}
        self._results: dict[str, CheckResult] = {}
        self._root: Check | None = None  # the check that reported a connector error met in a scenario
        #: the failed check each check not run was not run for: a check after it names that root, not it
        self._not_run_for: dict[str, Check] = {}

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per session under ``key``."""
        if key not in self._memo:
            self._memo[key] = compute()
        value: T = self._memo[key]
        return value

    def config_for(self, run: str) -> dict[str, Any] | None:
        """The connector's config for the scenario or data run named ``run``."""
        if self.config_factory is None:
            return self.config
        factory = self.config_factory
        takes_directory = len(inspect.signature(factory).parameters) >= 2
        config = factory(run, self.run_directory(run)) if takes_directory else factory(run)
        return dict(config) if config is not None else None

    def run_directory(self, run: str) -> Path:
        """A new, empty directory for ``run`` under the session's temporary directory (removed by :meth:`close`)."""
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="kvconn-conformance-")
        return Path(tempfile.mkdtemp(prefix=f"{run}-", dir=self._workdir.name))

    def close(self) -> None:
        """Remove the run directories (a store the connector kept there goes with them)."""
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def _declared_factory(self) -> ConfigFactory | None:
        """The connector's ``fresh_store_config`` laid over ``config``, when the connector declares one."""
        declared = getattr(self.cls, "fresh_store_config", None)
        inherited = KVConnector.fresh_store_config.__func__  # type: ignore[attr-defined]
        if declared is None or getattr(declared, "__func__", None) is inherited:  # declared by no class but the base
            return None

        def fresh(run: str, directory: Path) -> dict[str, Any] | None:
            fields = declared(run, directory)
            return self.config if fields is None else {**(self.config or {}), **fields}

        return fresh

    def _play(self, scenario: Scenario) -> Trace:
        return self.memo(
            f"trace:{scenario.name}",
            lambda: run_scenario(
                self.factory, scenario, self.connector, self.config_for(scenario.name), self.tags.next_run()
            ),
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
                raise ScenarioBroken(trace.error, _fix_for(trace.exception) or trace.fix)
        return traces

    def run(self, check: Check) -> CheckResult:
        """Run one check (once: the result is kept); never raises (an unexpected exception is a failure).

        Its message names requests as the scenarios do: the one place where the engine's request ids, in
        whatever observation, diagnosis or exception the message quotes, go back to their names.
        """
        if check.id not in self._results:
            result = self._run(check)
            self._results[check.id] = replace(result, message=self.tags.untag(result.message))
        return self._results[check.id]

    def _run(self, check: Check) -> CheckResult:
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
        for dependency in map(get_check, check.after):
            result = self.run(dependency)
            if result.status == "failed" or result.message.startswith(NOT_RUN):
                return self._not_run(check, self._not_run_for.get(dependency.id, dependency))
        try:
            check.function(self)
        except ScenarioBroken as exc:
            if self._root is not None:
                return self._not_run(check, self._root)
            self._root = check
            return CheckResult(check.id, check.name, "failed", exc.report(check.fix))
        except ConformanceFailure as exc:
            return CheckResult(check.id, check.name, "failed", exc.report(check.fix))
        except CheckSkipped as exc:
            return CheckResult(check.id, check.name, "skipped", str(exc))
        except Exception as exc:
            return CheckResult(check.id, check.name, "failed", f"{type(exc).__name__}: {exc}")
        return CheckResult(check.id, check.name, "passed")

    def _not_run(self, check: Check, cause: Check) -> CheckResult:
        """``check`` skipped for ``cause``, the failed check at the root (remembered for the checks after it)."""
        self._not_run_for[check.id] = cause
        return CheckResult(
            check.id, check.name, "skipped", f"{NOT_RUN}{cause.id} {cause.name} failed first (the root cause): fix it"
        )
