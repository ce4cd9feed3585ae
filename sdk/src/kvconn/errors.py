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
    "HookOverBudget",
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


class HookOverBudget(KVConnError, TimeoutError):
    """A connector's calls of one hook ran over the host's time budget ``calls`` times in a row.

    The host raises it (chained under :class:`ConnectorError`, or logged as the
    first error of a degraded connector) when it stops calling a connector that
    keeps stalling the engine's steps: every hook runs on the engine's step.
    """

    def __init__(self, hook: str, calls: int, budget_s: float, seconds: float) -> None:
        super().__init__(
            f"{calls} calls in a row took longer than the hook budget of {budget_s:g} s "
            f"(the last {seconds:.3f} s): degraded for the rest of the run, the engine no longer calls it"
        )
        self.hook = hook
        self.calls = calls
        self.budget_s = budget_s
        self.seconds = seconds


class BlockStateSerializationError(KVConnError, TypeError):
    """Something tried to pickle or encode a scheduler-local block state."""


class WireError(KVConnError, ValueError):
    """A scheduler output or connector metadata could not be encoded or decoded.

    ``connector`` names the connector whose metadata failed, when one did.
    """

    def __init__(self, message: str, connector: str | None = None) -> None:
        super().__init__(message)
        self.connector = connector
