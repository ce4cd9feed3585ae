"""Installed distributions that look like connectors but declare no entry point: the forgotten entry point.

A connector is found by name only through its ``kvconn.connectors`` entry point.
An author who forgets it (or edits ``pyproject.toml`` without reinstalling) sees
their connector missing from ``kvconn list`` and "no connector named ..." from
``validate``; :func:`warn_unregistered` tells them which distribution it is
and prints the exact ``pyproject.toml`` lines to add.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from importlib.metadata import Distribution, distributions
from urllib.parse import urlsplit
from urllib.request import url2pathname

import kvconn
from kvconn.install import pip_install
from kvconn.introspection import ENTRY_POINT_GROUP

from .errors import UsageError
from .inspection import plugin_output_to_stderr
from .output import warn

__all__ = ["Unregistered", "find_unregistered", "not_found", "warn_unregistered"]

#: kvconn's own distributions that are not connectors.
_NOT_CONNECTORS = frozenset({"kvconn-sdk", "kvconn-cli"})
#: Entry-point groups of kvconn's extension points (connectors, conformance drivers).
_KVCONN_GROUPS = "kvconn."
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True)
class Unregistered:
    """A distribution that depends on kvconn (or is named ``kvconn-*``) but declares no connector."""

    distribution: str
    version: str
    entry_name: str  # the connector name to declare: the distribution name without ``kvconn-``
    targets: tuple[str, ...]  # "package:Class" of the KVConnector subclasses found, or a placeholder
    reinstall: str = "reinstall it from its project directory"  # the command, where pip recorded the directory

    def pyproject_lines(self) -> list[str]:
        """The lines to add to the distribution's ``pyproject.toml``."""
        lines = [f'[project.entry-points."{ENTRY_POINT_GROUP}"]']
        for i, target in enumerate(self.targets):
            lines.append(f'{self.entry_name if i == 0 else self.entry_name + str(i + 1)} = "{target}"')
        return lines

    def message(self) -> str:
        """The warning: what is wrong, then the lines to add and how to make them count."""
        body = "\n".join(f"    {line}" for line in self.pyproject_lines())
        return (
            f"{self.distribution} {self.version} looks like a kvconn connector but declares no entry point in "
            f"the group '{ENTRY_POINT_GROUP}', so it cannot be loaded by name; add these lines to its "
            f"pyproject.toml, then {self.reinstall}:\n{body}"
        )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _looks_like_connector(name: str, requirements: list[str]) -> bool:
    if name.startswith("kvconn-"):
        return True
    names = (_REQUIREMENT_NAME.match(r) for r in requirements)
    return any(m is not None and _canonical(m.group(1)) == "kvconn-sdk" for m in names)


def _connector_classes(package: str) -> tuple[str, ...]:
    """``package:Class`` for each KVConnector subclass ``package`` defines; empty when it does not import."""
    try:
        with plugin_output_to_stderr():
            module = importlib.import_module(package)
    except (Exception, SystemExit):
        return ()
    return tuple(
        f"{package}:{name}"
        for name, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, kvconn.KVConnector)
        and obj is not kvconn.KVConnector
        and obj.__module__.split(".")[0] == package
    )


def _reinstall(dist: Distribution) -> tuple[str, ...]:
    """``("reinstall it: <command>",)`` when pip recorded the directory ``dist`` came from (PEP 610), else ``()``."""
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        return ()
    if not isinstance(direct, dict) or "dir_info" not in direct or not str(direct.get("url")).startswith("file://"):
        return ()
    path = url2pathname(urlsplit(direct["url"]).path)
    editable = ("-e",) if direct["dir_info"].get("editable") else ()
    return (f"reinstall it: {pip_install(*editable, path)}",)


def find_unregistered() -> list[Unregistered]:
    """Every installed distribution that looks like a connector and declares none, by name."""
    found: dict[str, Unregistered] = {}
    for dist in distributions():
        metadata = dist.metadata  # read once: each access parses the file again
        name = _canonical(metadata["Name"] or "")
        if not name or name in _NOT_CONNECTORS or name in found:
            continue
        if not _looks_like_connector(name, metadata.get_all("Requires-Dist") or []):
            continue
        if any(ep.group.startswith(_KVCONN_GROUPS) for ep in dist.entry_points):
            continue  # a connector, or another kvconn extension (an engine adapter's conformance driver)
        package = name.replace("-", "_")
        entry_name = name.removeprefix("kvconn-").replace("-", "_")
        targets = _connector_classes(package) or (f"{package}:<YourConnectorClass>",)
        found[name] = Unregistered(name, dist.version, entry_name, targets, *_reinstall(dist))
    return sorted(found.values(), key=lambda u: u.distribution)


def warn_unregistered() -> None:
    """Warn on stderr about each unregistered connector distribution."""
    for unregistered in find_unregistered():
        warn(unregistered.message())


def not_found(exc: kvconn.ConnectorNotFoundError) -> UsageError:
    """The usage error for a name that is not installed, after warning about forgotten entry points."""
    warn_unregistered()
    return UsageError(str(exc))
