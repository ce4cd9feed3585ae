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

import inspect
from typing import Any

import pluggy

from .. import hookspecs
from ..connector import KVConnector
from .markers import PROJECT_NAME, implements

__all__ = ["HOOK_NAMES", "KVConnPluginManager", "hook_object", "implemented_hooks"]

HOOK_NAMES = frozenset(name for name, _ in inspect.getmembers(hookspecs.KVConnectorSpec, inspect.isfunction))


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


def implemented_hooks(cls: type, *, by_name: bool | None = None) -> list[str]:
    """The hook names a connector class (or a side class) implements, sorted (no instance needed).

    ``by_name``: every method named after a hook counts, as on a side class;
    by default only on a :class:`KVConnector` subclass (others need ``@hookimpl``).
    """
    named = issubclass(cls, KVConnector) if by_name is None else by_name
    return sorted(name for name in HOOK_NAMES if implements(cls, name, by_name=named))
