"""``run_conformance``: every (selected) check against one connector."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatchcase
from typing import Any

from .catalog import Check, list_checks
from .results import CheckResult, ConnectorReport
from .session import ConfigFactory, Session

__all__ = ["connector_name", "matches", "open_session", "run_conformance", "run_session"]


def matches(check: Check, pattern: str | None) -> bool:
    """Whether ``pattern`` (fnmatch, case-insensitive) matches the check's id or name."""
    if pattern is None:
        return True
    pattern = pattern.lower()
    return fnmatchcase(check.id.lower(), pattern) or fnmatchcase(check.name.lower(), pattern)


def connector_name(connector: str | type) -> str:
    """``connector`` as the name a session loads: a class becomes ``"package.module:Class"``.

    The checks load a connector by name, as engines do (a worker process
    imports it anew), so a class is named by where it is importable from.
    """
    if isinstance(connector, str):
        return connector
    if isinstance(connector, type):
        return f"{connector.__module__}:{connector.__qualname__}"
    raise TypeError(
        f"connector must be an installed connector's name, 'package.module:Class' or a class, "
        f"not {type(connector).__name__} {connector!r}"
    )


def open_session(
    connector: str | type,
    config: Mapping[str, Any] | None = None,
    driver: str = "reference",
    config_factory: ConfigFactory | None = None,
) -> Session | str:
    """A session, or the one-line reason the connector (or driver) could not be loaded."""
    try:
        return Session(connector_name(connector), config, driver, config_factory)
    except (Exception, SystemExit) as exc:  # every load failure becomes a report, never a crash (nor an exit)
        return str(exc) or type(exc).__name__


def run_conformance(
    connector: str | type,
    *,
    config: Mapping[str, Any] | None = None,
    select: str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    driver: str = "reference",
    config_factory: ConfigFactory | None = None,
) -> ConnectorReport:
    """Run the conformance checks against ``connector``.

    Args:
        connector: an installed connector name, ``"package.module:Class"``, or the class itself
            (importable from its module: the checks load it by name, as engines do).
        config: the connector's config (its defaults when ``None``).
        select: an fnmatch pattern matched against check ids and names
            (``"KV01*"``, ``"*fill*"``); every check when ``None``.
        on_result: called with each result as soon as it is known (progress).
        driver: the scheduler driver (``"reference"``, or one registered
            with :func:`~.driver_registry.register_driver`).
        config_factory: called with each scenario's and data run's name (and,
            when it takes a second argument, a directory of the run's own,
            removed when the run ends) for that run's config; ``None``: the
            connector's ``fresh_store_config`` over ``config`` when it declares
            one, else ``config``. Gives a connector whose store outlives its
            instances (files, a server) a fresh store per run.

    Never raises for anything the connector does: a connector that cannot be
    loaded gives a report with ``load_error`` set and no results; a check that
    raises unexpectedly is reported failed.
    """
    session = open_session(connector, config, driver, config_factory)
    if isinstance(session, str):
        return ConnectorReport(connector if isinstance(connector, str) else repr(connector), [], load_error=session)
    try:
        return run_session(session, select=select, on_result=on_result)
    finally:
        session.close()


def run_session(
    session: Session, *, select: str | None = None, on_result: Callable[[CheckResult], None] | None = None
) -> ConnectorReport:
    """The selected checks on an open ``session`` (another engine's connector: see ``kvconn_vllm.testing.native``)."""
    report = ConnectorReport(session.connector)
    for check in list_checks():
        if not matches(check, select):
            continue
        result = session.run(check)
        report.results.append(result)
        if on_result is not None:
            on_result(result)
    return report
