"""The conformance suite: checks that catch the bugs KV connectors really have.

Usage::

    from kvconn.testing.conformance import run_conformance
    report = run_conformance("mine", config={...}, select="KV01*")
    assert report.ok, report.to_dict()

Each :class:`Check` has a stable id (``KV001``...), a short name, a
docstring saying which real bug it catches, and a fix. Checks that do not
apply to a connector (by its declared ``roles``, ``saves`` and ``loads``) are
skipped with the reason. ``docs/checks.md`` is the catalogue.

How the suite observes a connector
----------------------------------
Scripted scenarios (chunked prefill, decode across block boundaries, the
block-fill step, preemption and resume, aborts, two KV-cache groups, 256-token
blocks, many requests sharing prefixes) run through an engine with errors
raised (``on_error="raise"``). Each step records the connector's metadata, the
live block tables, the offered requests and every call of the block state's
resolver. What the metadata *acts on* is read from it: see
:mod:`kvconn.testing.conformance.metadata_blocks` for the optional
``Metadata.block_ids_by_request()`` convention and the fallback walk.

The driver protocol
-------------------
Scheduler-side checks (KV010-KV032) never touch an engine: they play
scenarios through a :class:`SchedulerDriver`, built by a factory
``DriverFactory = Callable[[DriverSpec], SchedulerDriver]``:

* ``add_request(req_id, prompt, max_tokens)``, ``abort(req_id)``;
* ``step(withhold=())`` runs one step and returns a :class:`StepRecord`: the
  scheduler output, the connector's metadata as built and as decoded by a
  worker (and its encoded bytes), the live table of every request holding
  blocks, the offered request ids, the resolver calls, the worker-side
  ``KVConnectorOutput`` and the requests preempted this step. Requests in
  ``withhold`` are left out of the offered block state;
* ``has_unfinished()``, ``has_work()`` (held blocks too), ``finished_calls()``
  (``request_finished`` calls per request), ``num_tracked_requests()`` (per
  role), ``assert_empty()``, ``close()``.

``DriverSpec`` carries the connector, its config and the
:class:`~kvconn.reference.EngineShape` (block size, ``num_blocks``: small to
force preemption, token budget, prefix caching, KV-cache groups). The ``"reference"`` driver runs kvconn's own
scheduler and worker; another engine plugs in with
``register_driver("vllm", factory)``, or declares ``vllm = "pkg.module:factory"``
in the ``kvconn.conformance_drivers`` entry-point group, and is then used with
``run_conformance(..., driver="vllm")``. A new driver records ``offered``
and ``resolved`` with :func:`~.driver.observe_block_state` and answers
``num_tracked_requests`` with :func:`~.driver.tracked_by_role`.
The data checks (KV040-KV049) need a worker side and a model: they play data
runs (:mod:`.runs`, phases of requests judged on their tokens) on
the factory's ``data_driver`` (a :class:`~.driver.DataDriver`; the reference
engine for a factory without one), with every freed block overwritten.
Injected load failures (:mod:`.fault_injection`) and a bound on connectors that keep
a request from finishing (:mod:`.convergence`) work at the hosts, in any engine.

Each scenario and data run builds new connector instances; a
``config_factory`` (``run_conformance(..., config_factory=f)``, or an
override of ``ConnectorConformance.config_factory``) gives each its own
config, e.g. a fresh namespace for a store that outlives its instances.
A check that depends on a failed check is skipped as ``"not run: ..."``:
the root cause is reported once.

Layout
------
Top to bottom, each module importing only those below it (the
``kvconn.testing.conformance`` layers contract in ``pyproject.toml``):
:mod:`.runner` (``run_conformance``); :mod:`.checks`; :mod:`.runs` (data runs)
and :mod:`.trace_steps` (a trace read step by step); :mod:`.session` (one
connector under test); :mod:`.driver_registry` (drivers by name);
:mod:`.reference_driver` (the reference engine's driver); :mod:`.scenarios` and
:mod:`.worker_process`; :mod:`.diagnose`; :mod:`.driver` (the protocol),
:mod:`.loaded_kv` (what a load landed in the KV cache) and
:mod:`.metadata_blocks` (what the metadata acts on); :mod:`.fault_injection`;
:mod:`.convergence`; :mod:`.catalog` (the check registry), :mod:`.results`,
:mod:`.waits` (the wall-clock bound on a run's waits) and :mod:`.request_ids`
(the request ids a run gives the engine, and their names in every message).
Read by: ``kvconn validate``, the pytest plugin, the adapters' drivers. Public:
``__all__`` below. A new check updates ``docs/checks.md``; a new module takes
its place in the contract.
"""

from __future__ import annotations

from . import checks as _checks  # noqa: F401  (registers every check)
from .catalog import CAPABILITIES, Check, list_checks
from .driver import DriverFactory, DriverSpec, ScenarioUnsupported, SchedulerDriver, StepRecord
from .driver_registry import available_drivers, get_driver, register_driver
from .metadata_blocks import INTROSPECTION_METHOD
from .reference_driver import ReferenceDriver
from .results import CheckResult, CheckSkipped, ConformanceFailure, ConnectorReport, Status
from .runner import matches, run_conformance, run_session
from .session import ConfigFactory, Session

__all__ = [
    "CAPABILITIES",
    "INTROSPECTION_METHOD",
    "Check",
    "CheckResult",
    "CheckSkipped",
    "ConfigFactory",
    "ConformanceFailure",
    "ConnectorReport",
    "DriverFactory",
    "DriverSpec",
    "ReferenceDriver",
    "ScenarioUnsupported",
    "SchedulerDriver",
    "Session",
    "Status",
    "StepRecord",
    "available_drivers",
    "get_driver",
    "list_checks",
    "matches",
    "register_driver",
    "run_conformance",
    "run_session",
]
