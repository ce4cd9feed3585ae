"""Finding and loading connectors by name.

Discovery reads entry-point metadata (group ``kvconn.connectors``) and imports
nothing; a plugin is imported only when it is loaded. A plugin that fails to
import is reported with its distribution and never affects the others.

Two environment variables restrict discovery everywhere (engine, CLI, host):
``KVCONN_PLUGINS`` (comma-separated allow-list) and
``KVCONN_DISABLE_PLUGINS`` (comma-separated block-list). They name plugins,
and apply to a ``"pkg.mod:Class"`` path too: a path into an installed plugin's
package is that plugin (``KVCONN_DISABLE_PLUGINS=offload`` refuses
``kvconn_offload:OffloadConnector``), and the block-list may also name a path
or a module or package of one (``kvconn.testing``). A path into code that is no
installed plugin is not a plugin: the allow-list does not restrict it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from ..connector import KVConnector, KVConnectorRole, NoConfig
from ..context import ConnectorContext
from ..errors import ConnectorConfigError, ConnectorLoadError, ConnectorNotFoundError
from ..version import check_api_version
from .manager import implemented_hooks
from .sides import check_roles, declared_side, import_target, refuse_sides_off_kvconnector

__all__ = [
    "ENTRY_POINT_GROUP",
    "ConnectorEntry",
    "available_connectors",
    "build_config",
    "connector_roles",
    "instantiate_connector",
    "load_connector",
    "load_connector_class",
]

ENTRY_POINT_GROUP = "kvconn.connectors"


@dataclass(frozen=True)
class ConnectorEntry:
    """An installed connector, as its entry point declares it (nothing imported)."""

    name: str
    target: str
    distribution: str | None
    version: str | None


def _env_names(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {n.strip() for n in value.split(",") if n.strip()}


def _filtered_out(name: str) -> str | None:
    """Why ``name`` is hidden by the environment, or ``None``."""
    allowed = _env_names("KVCONN_PLUGINS")
    if allowed is not None and name not in allowed:
        return f"it is not in KVCONN_PLUGINS={os.environ['KVCONN_PLUGINS']!r}"
    if name in (_env_names("KVCONN_DISABLE_PLUGINS") or ()):
        return f"it is disabled by KVCONN_DISABLE_PLUGINS={os.environ['KVCONN_DISABLE_PLUGINS']!r}"
    return None


def _path_filtered_out(path: str) -> str | None:
    """Why the connector path ``path`` is refused by the environment, or ``None`` (see the module docstring)."""
    module = path.partition(":")[0]
    parts = module.split(".")
    prefixes = {path} | {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    blocked = prefixes & (_env_names("KVCONN_DISABLE_PLUGINS") or set())
    if blocked:
        return f"{sorted(blocked)[0]!r} is disabled by KVCONN_DISABLE_PLUGINS={os.environ['KVCONN_DISABLE_PLUGINS']!r}"
    if "KVCONN_PLUGINS" not in os.environ and "KVCONN_DISABLE_PLUGINS" not in os.environ:
        return None
    # The plugins it belongs to: those whose target is in its module, else in its top-level package.
    targets = [(ep.name, ep.value.partition(":")[0]) for ep in _entry_points()]
    owners = [n for n, m in targets if m == module] or [n for n, m in targets if m.split(".")[0] == parts[0]]
    reasons = [f"it belongs to plugin {n!r} and {why}" for n in owners if (why := _filtered_out(n))]
    return reasons[0] if owners and len(reasons) == len(owners) else None


def _entry_points() -> Any:
    # importlib.metadata costs ~30 ms to import: only when discovery runs, not at `import kvconn`.
    from importlib.metadata import entry_points

    return entry_points(group=ENTRY_POINT_GROUP)


def available_connectors() -> dict[str, ConnectorEntry]:
    """Installed connectors by name, sorted, after the environment's filters.

    When two distributions declare the same name, the first found wins.
    """
    found: dict[str, ConnectorEntry] = {}
    for ep in _entry_points():
        if ep.name in found or _filtered_out(ep.name):
            continue
        dist = ep.dist
        found[ep.name] = ConnectorEntry(ep.name, ep.value, dist.name if dist else None, dist.version if dist else None)
    return dict(sorted(found.items()))


def load_connector_class(name: str) -> type:
    """The connector class for an installed ``name`` or a ``"pkg.mod:Class"`` path.

    Raises :class:`ConnectorNotFoundError` for an unknown name (listing the
    installed ones and the closest match) and :class:`ConnectorLoadError` when
    the plugin does not import, is not a connector, or targets an incompatible
    hook API.
    """
    if ":" in name:
        source = f"connector path {name!r}"
        hidden = _path_filtered_out(name)
        if hidden:
            raise ConnectorNotFoundError(f"{source} is not available: {hidden}")
        obj = import_target(name, source=source)
    else:
        installed = available_connectors()
        entry = installed.get(name)
        if entry is None:
            raise ConnectorNotFoundError(_not_found_message(name, installed))
        source = f"connector {name!r} (distribution {entry.distribution or '?'} {entry.version or ''})".replace(
            " )", ")"
        )
        obj = import_target(entry.target, source=source)
    return _check_connector_class(obj, source)


def _not_found_message(name: str, installed: Mapping[str, ConnectorEntry]) -> str:
    hidden = _filtered_out(name)
    if hidden and any(ep.name == name for ep in _entry_points()):
        return f"connector {name!r} is installed but not available: {hidden}"
    names = ", ".join(installed) or "none"
    message = f"no connector named {name!r} is installed (installed: {names})"
    close = difflib.get_close_matches(name, list(installed), n=1)
    message += f"; did you mean {close[0]!r}? " if close else ". "
    return message + "Install its distribution, or pass 'package.module:ClassName'."


def _check_connector_class(obj: object, source: str) -> type:
    if not isinstance(obj, type):
        raise ConnectorLoadError(f"{source} is {type(obj).__name__} {obj!r}, not a connector class")
    if not issubclass(obj, KVConnector):
        refuse_sides_off_kvconnector(obj)
    has_sides = any(declared_side(obj, role.value) is not None for role in KVConnectorRole)
    if not has_sides and not implemented_hooks(obj):
        how = (
            "define methods named after the hooks in kvconn.hookspecs (build_connector_meta, save_kv_layer, ...)"
            if issubclass(obj, KVConnector)
            else "subclass kvconn.KVConnector and define methods named after the hooks in kvconn.hookspecs, "
            "or mark methods with @kvconn.hookimpl"
        )
        raise ConnectorLoadError(f"{source}: {obj.__qualname__} implements no hook: {how}")
    check_roles(obj, by_name=issubclass(obj, KVConnector))
    declared = getattr(obj, "api_version", None)
    if declared is None:
        raise ConnectorLoadError(f"{source}: {obj.__qualname__} declares no api_version (e.g. api_version = '1.0')")
    why = check_api_version(declared)
    if why:
        raise ConnectorLoadError(f"{source} cannot load: {why}")
    return obj


_MSGSPEC_PATH = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")


def build_config(cls: type, config: Mapping[str, Any] | msgspec.Struct | None, *, name: str) -> msgspec.Struct:
    """Validate ``config`` into ``cls.Config``; errors name the field and the expected type."""
    config_type: type[msgspec.Struct] = getattr(cls, "Config", NoConfig)
    if isinstance(config, config_type):
        return config
    if config is not None and not isinstance(config, Mapping):
        raise ConnectorConfigError(
            f"config for connector {name!r} must be a mapping of field names to values, got {type(config).__name__}"
        )
    try:
        return msgspec.convert(dict(config or {}), config_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConnectorConfigError(_config_message(name, config_type, str(exc))) from None


def _config_message(name: str, config_type: type[msgspec.Struct], detail: str) -> str:
    match = _MSGSPEC_PATH.match(detail)
    what, path = (match["what"], match["path"]) if match else (detail, None)
    # msgspec quotes names and types with backticks: quote names, leave types bare.
    what = what.replace("`", "" if what.startswith("Expected") else "'")
    if "unknown field" in what:
        unknown = re.search(r"unknown field '([^']*)'", what)
        renamed: Mapping[str, str] = getattr(config_type, "renamed_fields", {})
        if unknown and unknown[1] in renamed:
            return (
                f"invalid config for connector {name!r}: field {unknown[1]!r} was renamed to "
                f"{renamed[unknown[1]]!r}: use the new name"
            )
        fields = ", ".join(f.name for f in msgspec.structs.fields(config_type)) or "none"
        return f"invalid config for connector {name!r}: {what.replace('Object contains ', '')}; valid fields: {fields}"
    where = f"field {path.lstrip('.')!r}" if path else "config"
    return f"invalid config for connector {name!r}: {where}: {what[0].lower() + what[1:]}"


def connector_roles(cls: type) -> frozenset[KVConnectorRole]:
    """The roles a connector class serves (both, unless it says otherwise)."""
    return frozenset(KVConnectorRole(r) for r in getattr(cls, "roles", KVConnectorRole))


def load_connector(
    name: str,
    *,
    role: KVConnectorRole | str,
    config: Mapping[str, Any] | msgspec.Struct | None = None,
    context: ConnectorContext | None = None,
) -> Any:
    """Find, import, configure and instantiate a connector for one role.

    ``name`` is an installed connector name or ``"package.module:ClassName"``.
    Returns the connector instance; when its class declares a side for
    ``role``, that side is built and held as ``connector.side`` (the object
    whose methods are the hooks, see :mod:`kvconn._plugins.sides`).
    """
    return instantiate_connector(load_connector_class(name), name, role=role, config=config, context=context)


def instantiate_connector(
    cls: type,
    name: str,
    *,
    role: KVConnectorRole | str,
    config: Mapping[str, Any] | msgspec.Struct | None = None,
    context: ConnectorContext | None = None,
) -> Any:
    """Configure and instantiate an already loaded connector class (see :func:`load_connector`)."""
    role = KVConnectorRole(role)
    roles = connector_roles(cls)
    if role not in roles:
        raise ConnectorLoadError(
            f"connector {name!r} does not serve the {role.value} role (roles: {sorted(r.value for r in roles)})"
        )
    cfg = build_config(cls, config, name=name)
    try:
        return cls(cfg, role=role, context=context or ConnectorContext())
    except (ConnectorConfigError, ConnectorLoadError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # sys.exit in a constructor included
        raise ConnectorLoadError(
            f"connector {name!r} failed to start ({role.value}): {type(exc).__name__}: {exc}"
        ) from exc
