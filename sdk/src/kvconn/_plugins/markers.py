"""The pluggy markers of the ``kvconn`` project.

``@hookimpl`` marks a connector method as a hook implementation. Subclasses of
:class:`kvconn.KVConnector` and their sides need no marker: their methods named
after a hook already count (as ``pytest_*`` functions do in pytest).
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]

PROJECT_NAME = "kvconn"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
