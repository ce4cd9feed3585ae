"""The pluggy plugin manager of kvconn.

Its one addition to pluggy: methods of :class:`~kvconn.connector.KVConnector`
subclasses named after a hook are implementations without ``@hookimpl``, as
``pytest_*`` functions are in pytest. Hook arguments are still validated
against the specs at registration (an unknown argument name is an error).
"""

from __future__ import annotations

import inspect
from typing import Any

import pluggy

from .. import hookspecs
from ..connector import KVConnector
from .markers import PROJECT_NAME

__all__ = ["HOOK_NAMES", "KVConnPluginManager", "implemented_hooks"]

HOOK_NAMES = frozenset(name for name, _ in inspect.getmembers(hookspecs.KVConnectorSpec, inspect.isfunction))


class KVConnPluginManager(pluggy.PluginManager):
    """A ``PluginManager`` for project ``kvconn`` with the hookspecs registered."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs.KVConnectorSpec)

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if (
            opts is None
            and name in HOOK_NAMES
            and isinstance(plugin, KVConnector)
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


def implemented_hooks(cls: type) -> list[str]:
    """The hook names a connector class implements, sorted (no instance needed)."""
    marker = f"{PROJECT_NAME}_impl"
    return sorted(
        name
        for name in HOOK_NAMES
        if callable(attr := getattr(cls, name, None)) and (issubclass(cls, KVConnector) or hasattr(attr, marker))
    )
