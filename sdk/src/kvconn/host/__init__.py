"""What an engine drives: the connector host and the wire between scheduler and workers.

* :mod:`.connector_host` — :class:`ConnectorHost`, the only caller of hooks:
  constructing it by role builds a :class:`SchedulerHost`
  (:mod:`.scheduler_host`: routing lookups and loads, the transfers in
  flight) or a :class:`WorkerHost` (:mod:`.worker_host`: caches, metadata,
  the per-layer hooks, each step's report). Both share :mod:`.dispatch`
  (registration, calling hooks, the failure policy), :mod:`.answers`
  (checks of each hook's answer) and :mod:`.monitors` (``add_monitor``,
  for tools that observe a host).
* :mod:`.wire` — msgpack encoding of ``SchedulerOutput`` / ``ModelRunnerOutput``
  and of each connector's metadata, for engines whose workers run elsewhere.

Read by: engines (the reference engine, the vLLM adapter, the SGLang tier) and
the conformance drivers. Public: ``__all__`` below (every public name of the
modules an engine uses; ``sdk/tests/test_layout.py`` checks it) and :mod:`.wire`. The role hosts
sit above :mod:`.connector_host`, which sits above the shared :mod:`.dispatch`
and :mod:`.monitors` (the ``kvconn.host`` layers contract): a role's class
declares its role (``class SchedulerHost(ConnectorHost, role=...)``) and
``ConnectorHost(..., role=...)`` builds the class declared for it, so this
package imports both role modules. The hook sets each role calls, and the host
calls monitors watch, come from the tags of :mod:`kvconn.hookspecs`. A change
to the step path is measured with ``benchmarks/host_dispatch.py``.
"""

from __future__ import annotations

from .answers import BadHookAnswer
from .connector_host import ConnectorHost
from .dispatch import (
    DEFAULT_HOOK_BUDGET_S,
    DEFAULT_MAX_SLOW_CALLS,
    DEFAULT_STALL_S,
    DEFAULT_STALL_STEPS,
    HostOptions,
    OnError,
)
from .monitors import MONITORED_CALLS, STEP_CALLS, CallOutcome, MonitorAfter, MonitorBefore
from .scheduler_host import NO_LOAD, LoadPlan, LoadSpec, SchedulerHost, StepUpdate
from .worker_host import WorkerHost

__all__ = [
    "DEFAULT_HOOK_BUDGET_S",
    "DEFAULT_MAX_SLOW_CALLS",
    "DEFAULT_STALL_S",
    "DEFAULT_STALL_STEPS",
    "MONITORED_CALLS",
    "NO_LOAD",
    "STEP_CALLS",
    "BadHookAnswer",
    "CallOutcome",
    "ConnectorHost",
    "HostOptions",
    "LoadPlan",
    "LoadSpec",
    "MonitorAfter",
    "MonitorBefore",
    "OnError",
    "SchedulerHost",
    "StepUpdate",
    "WorkerHost",
]
