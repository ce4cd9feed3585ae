"""The pluggy plugin manager of kvconn.

Its additions to pluggy: methods of :class:`~kvconn.connector.KVConnector`
subclasses, and of the side objects they declare (see :mod:`kvconn._plugins.sides`),
named after a hook are implementations without ``@hookimpl``, as ``pytest_*``
functions are in pytest; and :meth:`KVConnPluginManager.register_connector`
registers a connector's side in its place when it has one. Hook arguments are
still validated against the specs at registration (an unknown argument name is
an error).
"""

from __future__ import annotations

from typing import Any

import pluggy

from .. import hookspecs
from ..connector import KVConnector
from ..errors import ConnectorLoadError
from ..hookspecs import HOOK_NAMES, ROLE_HOOKS
from .markers import PROJECT_NAME, implements
from .sides import declared_side, refuse_sides_off_kvconnector

__all__ = ["HOOK_NAMES", "KVConnPluginManager", "check_side", "hook_object", "implemented_hooks"]


class KVConnPluginManager(pluggy.PluginManager):
    """A ``PluginManager`` for project ``kvconn`` with the hookspecs registered."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs.KVConnectorSpec)
        self._sides: list[object] = []  # registered side objects: their hook-named methods are hooks

    def register_connector(self, connector: object, name: str) -> None:
        """Register ``connector`` under ``name``: its side for its role when it has one, else itself."""
        plugin = hook_object(connector)
        if plugin is not connector:
            self._sides.append(plugin)
        self.register(plugin, name=name)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if (
            opts is None
            and name in HOOK_NAMES
            and (isinstance(plugin, KVConnector) or any(plugin is side for side in self._sides))
            and callable(getattr(plugin, name, None))
        ):
            return {
                "wrapper": False,
                "hookwrapper": False,
                "optionalhook": False,
                "tryfirst": False,
                "trylast": False,
                "specname": None,
            }
        return opts


def hook_object(connector: object) -> object:
    """The object whose methods are ``connector``'s hooks: its ``side`` for its role, else itself."""
    # getattr: a connector whose __init__ skips KVConnector's has no side (nor declares one it could use).
    side = getattr(connector, "side", None) if isinstance(connector, KVConnector) else None
    return connector if side is None else side


def check_side(name: str, connector: object, role: str) -> None:
    """Refuse a connector with sides whose registered object would not be its side for the host's ``role``.

    Its hooks live on its sides, so registering anything else (the side of
    the other role, or the bare connector) would leave this role without
    hooks: every save and load silently skipped. ``name`` is the host's name
    for the connector, ``role`` a role value.
    """
    cls = type(connector)
    if not isinstance(connector, KVConnector):
        refuse_sides_off_kvconnector(cls)
        return
    if all(declared_side(cls, r) is None for r in ROLE_HOOKS):
        return  # a connector that is its own hooks serves either role
    built_for = getattr(connector, "role", None)
    if built_for is not None and built_for != role:  # a str enum: "worker" (a str) is the worker role
        built = getattr(built_for, "value", built_for)
        raise ConnectorLoadError(
            f"connector {name!r} ({cls.__qualname__}) was built for the {built} role, not the {role} role of "
            "this host: its hooks are on the side of its role; build one instance per role"
        )
    if declared_side(cls, role) is not None and getattr(connector, "side", None) is None:
        raise ConnectorLoadError(
            f"connector {name!r}: {cls.__qualname__} declares a {role}_side but has no side built: its "
            "__init__ must call super().__init__(config, role=role, context=context), which builds it"
        )


def implemented_hooks(cls: type, *, by_name: bool | None = None) -> list[str]:
    """The hook names a connector class (or a side class) implements, sorted (no instance needed).

    ``by_name``: every method named after a hook counts, as on a side class;
    by default only on a :class:`KVConnector` subclass (others need ``@hookimpl``).
    """
    named = issubclass(cls, KVConnector) if by_name is None else by_name
    return sorted(name for name in HOOK_NAMES if implements(cls, name, by_name=named))
