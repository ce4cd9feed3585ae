"""The pluggy markers of the ``kvconn`` project.

``@hookimpl`` marks a connector method as a hook implementation. Subclasses of
:class:`kvconn.KVConnector` and their sides need no marker: their methods named
after a hook already count (as ``pytest_*`` functions do in pytest).
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", "implements"]

PROJECT_NAME = "kvconn"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

_IMPL_ATTR = f"{PROJECT_NAME}_impl"  # what @hookimpl sets on a function


def implements(cls: type, hook: str, *, by_name: bool) -> bool:
    """Whether ``cls`` has a method for ``hook``: any method so named when ``by_name``, else a marked one."""
    attr = getattr(cls, hook, None)
    return callable(attr) and (by_name or hasattr(attr, _IMPL_ATTR))
