"""The errors kvconn raises.

Every error an engine or a connector author can meet derives from
:class:`KVConnError`, so an engine can catch one type at the plugin boundary.
Messages name what is wrong *and* what to do about it: they are read by people
who did not write the plugin.
"""

from __future__ import annotations

__all__ = [
    "BlockStateSerializationError",
    "ConnectorConfigError",
    "ConnectorError",
    "ConnectorLoadError",
    "ConnectorNotFoundError",
    "KVConnError",
    "WireError",
]


class KVConnError(Exception):
    """Base class of every kvconn error."""


class ConnectorNotFoundError(KVConnError, LookupError):
    """No installed connector has the requested name."""


class ConnectorLoadError(KVConnError, ImportError):
    """A connector was found but could not be imported or is not a valid connector."""


class ConnectorConfigError(KVConnError, ValueError):
    """A connector's configuration does not match its config schema."""


class ConnectorError(KVConnError, RuntimeError):
    """A connector raised inside a hook (re-raised under ``on_error="raise"``).

    ``connector`` and ``hook`` name where it happened; the original exception
    is chained as ``__cause__``.
    """

    def __init__(self, connector: str, hook: str, exc: BaseException) -> None:
        super().__init__(f"connector {connector!r} failed in {hook}: {type(exc).__name__}: {exc}")
        self.connector = connector
        self.hook = hook


class BlockStateSerializationError(KVConnError, TypeError):
    """Something tried to pickle or encode a scheduler-local block state."""


class WireError(KVConnError, ValueError):
    """A scheduler output or connector metadata could not be encoded or decoded.

    ``connector`` names the connector whose metadata failed, when one did.
    """

    def __init__(self, message: str, connector: str | None = None) -> None:
        super().__init__(message)
        self.connector = connector
