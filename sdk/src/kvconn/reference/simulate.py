"""Drive a workload through the reference engine with connectors, and collect what the engine did.

What a connector buys is prompt tokens that are loaded instead of computed.
:func:`run_workload` runs one :class:`~kvconn.reference.workloads.Workload`
(one *pass*) on an :class:`~kvconn.reference.Engine` with the connectors of a
:class:`ConnectorSetup` (or none) and records per engine step:

* prompt tokens computed, loaded from a connector and served by the local
  prefix cache (deltas of the cumulative ``engine.stats``, sampled after each
  ``engine.step()``);
* **connector time**: wall time spent inside the ``ConnectorHost`` calls of
  both the scheduler and the worker side (the SDK's dispatch plus the
  connectors' own hook code, including the copies they make synchronously).
  Work a connector does on its own threads is not in it, which is the point:
  it is what the engine's step waits for;
* step wall time;

and per pass: the engine's stats, wall and CPU time, every request's
generated tokens (the reference model's next token depends on the KV it
reads, so a run whose tokens differ from a run without a connector loaded
wrong or stale KV) and the hooks that failed.

This is the driver; how to measure with it is not here. ``kvconn simulate``
(:mod:`kvconn_cli.measure`) runs passes without and with connectors in
interleaved, timed rounds and reports medians; a test runs one pass and reads
its counters.

The engine options matter: with a large local prefix cache the connector has
nothing to do. :data:`SIMULATE_SHAPE` is a local prefix cache that holds only
a fraction of the workload's prefixes, as in real serving, where the GPU
cache is much smaller than the working set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..host import STEP_CALLS, CallOutcome, ConnectorHost
from .engine import Engine
from .request import Request
from .shape import EngineShape
from .stats import EngineStats
from .workloads import Workload

__all__ = [
    "HOST_CALLS",
    "SIMULATE_SHAPE",
    "ConnectorSetup",
    "HookFailure",
    "ProgressCallback",
    "RunResult",
    "StepSample",
    "check_setup",
    "run_workload",
]

#: The ``ConnectorHost`` methods an engine calls per step; connector time is measured around them.
HOST_CALLS = STEP_CALLS

#: ``on_progress(label, requests_finished, requests)``, called after every engine step of a pass.
ProgressCallback = Callable[[str, int, int], None]

#: The engine every simulation runs unless told otherwise: a local (GPU-side) pool of 256 blocks that
#: running requests and the local prefix cache share, so local prefix hits are evicted and a connector can
#: serve them again; a few requests at a time.
SIMULATE_SHAPE = EngineShape(num_blocks=256, max_num_batched_tokens=1024, max_num_seqs=4)


@dataclass(frozen=True)
class ConnectorSetup:
    """One run with connectors: their names (several run together in one host) and config."""

    names: tuple[str, ...]
    config: Mapping[str, Any] | None = None
    #: What reports call this run; the names joined with "+" when empty (set it when setups repeat).
    run_label: str = ""

    @property
    def label(self) -> str:
        return self.run_label or "+".join(self.names)


@dataclass(frozen=True)
class StepSample:
    """What one engine step did; token counts are this step's, not cumulative."""

    step: int
    prompt_tokens_computed: int
    prompt_tokens_loaded: int
    prompt_tokens_cached: int
    connector_s: float
    step_s: float
    requests_finished: int


@dataclass(frozen=True)
class HookFailure:
    """How often one connector's hook failed (raised or answered out of contract) in a run, and the first error."""

    connector: str
    hook: str
    count: int
    first_error: str


@dataclass
class RunResult:
    """One pass of the workload (:func:`run_workload`): counters, times, per-step samples and outputs."""

    label: str
    connectors: tuple[str, ...]
    stats: EngineStats
    #: wall seconds while the workload ran (the engine's construction and its connectors' loading left out)
    wall_s: float
    connector_s: float
    samples: list[StepSample]
    outputs: list[list[int]]
    #: the degraded hook calls behind ``stats.degraded_events``, per connector and hook
    hook_failures: list[HookFailure] = field(default_factory=list)
    #: CPU seconds of this process while the workload ran (see ``wall_s``)
    cpu_s: float = 0.0

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def connector_ms_per_step(self) -> float:
        return 1e3 * self.connector_s / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of all prompt tokens that were loaded from a connector."""
        return self.stats.prompt_tokens_loaded / self.stats.prompt_tokens if self.stats.prompt_tokens else 0.0

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        """The pass as JSON: label, connectors, the stats' counters, hit rate, times and hook failures."""
        doc: dict[str, Any] = {
            "label": self.label,
            "connectors": list(self.connectors),
            **self.stats.as_dict(),
            "hit_rate": self.hit_rate,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "connector_s": self.connector_s,
            "connector_ms_per_step": self.connector_ms_per_step,
            "hook_failures": [asdict(f) for f in self.hook_failures],
        }
        if samples:
            doc["samples"] = [asdict(s) for s in self.samples]
        return doc


class _HostTimer:
    """Accumulates wall time spent inside the hosts' per-step calls.

    A monitor on each host (:meth:`ConnectorHost.add_monitor`) around the
    calls in :data:`HOST_CALLS` reads the clock before and after each: two
    ``perf_counter`` calls, well under a microsecond. Host calls never nest,
    so one start time serves both hosts.
    """

    def __init__(self, hosts: Sequence[ConnectorHost | None]) -> None:
        self.total = 0.0
        self._started = 0.0
        for host in hosts:
            if host is not None:
                host.add_monitor(self._before, self._after, calls=HOST_CALLS)

    def _before(self, call: str, args: tuple[Any, ...]) -> None:
        self._started = time.perf_counter()

    def _after(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        self.total += time.perf_counter() - self._started


def run_workload(
    workload: Workload,
    shape: EngineShape,
    setup: ConnectorSetup | None = None,
    *,
    on_progress: ProgressCallback | None = None,
    max_steps: int = 200_000,
    model: str = "kvconn-reference",
) -> RunResult:
    """Run ``workload`` on one engine; requests are submitted at their arrival step, after their dependency.

    While nothing is running and the next request has not arrived, the clock
    jumps to its arrival instead of stepping an idle engine. ``model`` names
    the engine's model in the connectors' context: stores that namespace their
    keys by it (as kvconn asks) start empty under a name not used before.
    """
    label = setup.label if setup else "no connector"
    engine = Engine(
        list(setup.names) if setup else None,
        setup.config if setup else None,
        model=model,
        shape=shape,
    )
    timer = _HostTimer([engine.scheduler_host, engine.worker_host])
    requests = workload.requests
    handles: list[Request | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    samples: list[StepSample] = []
    stats = engine.stats
    clock = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    with engine:
        while pending or engine.scheduler.has_work():
            ready = [i for i in pending if _ready(requests[i].after, handles)]
            for i in ready:
                if requests[i].arrival_step <= clock:
                    r = requests[i]
                    handles[i] = engine.add_request(r.prompt, r.max_tokens, request_id=f"req-{i}")
                    pending.remove(i)
            if not engine.scheduler.has_work():
                clock = min(requests[i].arrival_step for i in ready)  # idle: fast-forward to the next arrival
                continue
            if len(samples) >= max_steps:
                raise RuntimeError(f"{label}: {len(pending)} requests still pending after {max_steps} steps")
            before = (stats.prompt_tokens_computed, stats.prompt_tokens_loaded, stats.prompt_tokens_cached)
            connector_before = timer.total
            step_start = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - step_start
            finished = stats.requests_finished
            samples.append(
                StepSample(
                    step=len(samples),
                    prompt_tokens_computed=stats.prompt_tokens_computed - before[0],
                    prompt_tokens_loaded=stats.prompt_tokens_loaded - before[1],
                    prompt_tokens_cached=stats.prompt_tokens_cached - before[2],
                    connector_s=timer.total - connector_before,
                    step_s=step_s,
                    requests_finished=finished,
                )
            )
            clock += 1
            if on_progress is not None:
                on_progress(label, finished, len(requests))
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [list(h.output_token_ids) if h is not None else [] for h in handles]
    failures = [
        HookFailure(name, hook, count, host.first_errors[name, hook])
        for host in (engine.scheduler_host, engine.worker_host)
        if host is not None
        for (name, hook), count in sorted(host.error_counts.items())
    ]
    # read engine.stats again: it sums the hosts' degraded events when read
    names = setup.names if setup else ()
    return RunResult(label, names, engine.stats, wall_s, timer.total, samples, outputs, failures, cpu_s)


def _ready(after: int | None, handles: Sequence[Request | None]) -> bool:
    if after is None:
        return True
    dependency = handles[after]
    return dependency is not None and dependency.is_finished


def check_setup(setup: ConnectorSetup) -> None:
    """Load ``setup``'s connectors (import, config, API version) and shut them down: a bad name fails fast.

    Raises the SDK's errors (:class:`~kvconn.ConnectorNotFoundError`,
    :class:`~kvconn.ConnectorConfigError`, ...), as :func:`run_workload`
    would, but before a caller has spent time on other runs.
    """
    ConnectorHost.from_names(list(setup.names), role="scheduler", config=setup.config).shutdown()
