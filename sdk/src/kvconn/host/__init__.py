"""What an engine drives: the connector host and the wire between scheduler and workers.

* :mod:`.connector_host` — :class:`ConnectorHost`, the only caller of hooks:
  routing across several connectors, the failure policy, checks of each
  hook's answer, and monitors (``add_monitor``) for tools that observe it.
* :mod:`.wire` — msgpack encoding of ``SchedulerOutput`` / ``ModelRunnerOutput``
  and of each connector's metadata, for engines whose workers run elsewhere.
"""

from __future__ import annotations

from .connector_host import (
    DEFAULT_HOOK_BUDGET_S,
    DEFAULT_MAX_SLOW_CALLS,
    DEFAULT_STALL_STEPS,
    MONITORED_CALLS,
    NO_LOAD,
    STEP_CALLS,
    BadHookAnswer,
    CallOutcome,
    ConnectorHost,
    LoadPlan,
    MonitorAfter,
    MonitorBefore,
    OnError,
    StepUpdate,
)

__all__ = [
    "DEFAULT_HOOK_BUDGET_S",
    "DEFAULT_MAX_SLOW_CALLS",
    "DEFAULT_STALL_STEPS",
    "MONITORED_CALLS",
    "NO_LOAD",
    "STEP_CALLS",
    "BadHookAnswer",
    "CallOutcome",
    "ConnectorHost",
    "LoadPlan",
    "MonitorAfter",
    "MonitorBefore",
    "OnError",
    "StepUpdate",
]
