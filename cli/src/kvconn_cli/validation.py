"""What ``kvconn validate`` runs, separated from how it is shown.

Usage problems are found before any check runs, so a typo does not cost a
full run: connector names are looked up (did-you-mean from the registry),
``--module`` paths are checked for shape, ``--check`` must select something,
and ``--config`` is validated against each connector's ``Config`` (a wrong
field type is a usage error naming the field). A connector that is found but
does not import is *not* a usage error: the conformance run reports it as a
load error and the command exits 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kvconn
from kvconn.introspection import build_config

from .errors import UsageError
from .inspection import import_connector_class, one_line, reason
from .unregistered import not_found

if TYPE_CHECKING:
    from kvconn.testing.conformance import Check

__all__ = ["LoadProblem", "check_vllm_connectors", "preflight", "resolve_targets", "select_checks"]


def resolve_targets(
    names: Sequence[str], all_installed: bool, modules: Sequence[str], *, others: bool = False
) -> list[str]:
    """The connectors to validate, in order, without duplicates: names, then ``--all``, then ``--module`` paths.

    ``others``: vLLM connectors are validated too (``--vllm-connector``), so no kvconn connector is needed.
    """
    if not names and not all_installed and not modules and not others:
        raise UsageError(
            "name the connectors to validate, or pass --all, --module package.module:ClassName or --vllm-connector"
        )
    installed = kvconn.available_connectors()
    for name in names:
        # A "package.module:Class" path given positionally is accepted like --module.
        if ":" not in name and name not in installed:
            try:
                kvconn.load_connector_class(name)  # raises with the installed names and a did-you-mean
            except kvconn.ConnectorNotFoundError as exc:
                raise not_found(exc) from None
    for module in modules:
        module_name, _, attr = module.partition(":")
        if not module_name or not attr:
            raise UsageError(f"--module {module!r} is not a connector path: use the form 'package.module:ClassName'")
    if all_installed and not installed:
        raise UsageError("--all found no installed connector (check KVCONN_PLUGINS / KVCONN_DISABLE_PLUGINS)")
    targets = [*names, *(installed if all_installed else ()), *modules]
    return list(dict.fromkeys(targets))


def check_vllm_connectors(connectors: Sequence[str], engine: str, config_factory: str | None) -> list[str]:
    """The ``--vllm-connector`` targets, without duplicates; a usage error where they cannot run as asked."""
    if not connectors:
        return []
    if engine != "vllm":
        raise UsageError("--vllm-connector judges a vLLM connector in vLLM's scheduler: pass --engine vllm too")
    if config_factory is not None:
        raise UsageError("--config-factory configures kvconn connectors only; give a vLLM connector --config")
    for name in connectors:
        module, colon, attr = name.rpartition(":")
        if colon and (not module or not attr):
            raise UsageError(f"--vllm-connector {name!r}: give a name in vLLM's KVConnectorFactory or 'pkg.mod:Class'")
    return list(dict.fromkeys(connectors))


def select_checks(checks: Sequence[Check], pattern: str | None) -> list[Check]:
    """The checks ``--check PATTERN`` selects, matched as ``run_conformance`` matches them; all without one."""
    from kvconn.testing.conformance import matches

    selected = [c for c in checks if matches(c, pattern)]
    if not selected:
        example = f" (ids look like {checks[0].id!r})" if checks else ""
        raise UsageError(
            f"--check {pattern!r} matches no check id or name{example}: "
            "use a shell-style pattern such as 'KV0*' or '*block*'; see docs/checks.md"
        )
    return selected


@dataclass(frozen=True)
class LoadProblem:
    """A connector that was found but does not load: shown with the report, traceback under ``--debug``."""

    target: str
    error: BaseException

    @property
    def message(self) -> str:
        """The one-line reason, as ``kvconn list`` shows it."""
        return reason(self.error)


def preflight(targets: Sequence[str], config: Mapping[str, Any] | None) -> list[LoadProblem]:
    """Import each target's class and validate ``config`` against it.

    Raises :class:`UsageError` for a config that does not fit a connector;
    returns the targets that do not load (the run reports them, exit 1).
    """
    problems = []
    for target in targets:
        try:
            cls = import_connector_class(target)
        except Exception as exc:
            problems.append(LoadProblem(target, exc))
            continue
        if config is not None:
            try:
                build_config(cls, config, name=target)
            except kvconn.ConnectorConfigError as exc:
                raise UsageError(f"{one_line(str(exc))}; fix --config / --config-file") from None
    return problems
