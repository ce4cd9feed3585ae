"""Drive a workload through the reference engine with and without connectors, side by side.

What a connector buys is prompt tokens that are loaded instead of computed.
:func:`simulate` runs one :class:`~kvconn.reference.workloads.Workload` on a
connector-less :class:`~kvconn.reference.Engine` (the baseline) and then once per
connector setup, with the same engine options, and records per engine step:

* prompt tokens computed, loaded from a connector and served by the local
  prefix cache (deltas of the cumulative ``engine.stats``, sampled after each
  ``engine.step()``);
* **connector time**: wall time spent inside the ``ConnectorHost`` calls of
  both the scheduler and the worker side (the SDK's dispatch plus the
  connectors' own hook code, including the copies they make synchronously).
  Work a connector does on its own threads is not in it, which is the point:
  it is what the engine's step waits for;
* step wall time.

Every request's generated tokens are compared with the baseline's: the
reference model's next token depends on the KV it reads, so a wrong or stale
load shows up as a mismatch.

Timings are fair on a shared machine: one untimed warm-up round runs the
baseline and every setup once (imports, first calls of torch at each size),
then ``repeats`` timed rounds run them all in turn, the order rotated each
round, so a slow spell lands on every run alike and no run always goes first.
Figures are the median round's (by wall time), with the slowest round's
steps/s beside them.

The engine options matter: with a large local prefix cache the connector has
nothing to do. :class:`EngineOptions` defaults to a local prefix cache that
holds only a fraction of the workload's prefixes, as in real serving, where
the GPU cache is much smaller than the working set.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..host import STEP_CALLS, CallOutcome, ConnectorHost
from .engine import Engine
from .request import Request
from .stats import EngineStats
from .workloads import Workload, reusable_prompt_tokens

__all__ = [
    "HOST_CALLS",
    "ConnectorSetup",
    "EngineOptions",
    "HookFailure",
    "RunResult",
    "Simulation",
    "StepSample",
    "run_workload",
    "simulate",
]

#: The ``ConnectorHost`` methods an engine calls per step; connector time is measured around them.
HOST_CALLS = STEP_CALLS

ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True)
class EngineOptions:
    """Reference-engine options shared by every run of a simulation.

    ``num_blocks`` is the local (GPU-side) block pool: running requests and
    the local prefix cache share it, so a small pool means local prefix hits
    are evicted and a connector can serve them again.
    """

    block_size: int = 16
    num_blocks: int = 256
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 4

    def scheduler_options(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line saying what the local cache can hold (what the connector competes with)."""
        if not self.enable_prefix_caching:
            return "local prefix cache: off (every prefix hit must come from a connector)"
        return (
            f"local prefix cache: {self.num_blocks} blocks x {self.block_size} tokens "
            f"({self.num_blocks * self.block_size} tokens, shared with running requests)"
        )


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
    """One run of the workload: counters, timings, per-step samples and outputs."""

    label: str
    connectors: tuple[str, ...]
    stats: EngineStats
    wall_s: float
    connector_s: float
    samples: list[StepSample]
    outputs: list[list[int]]
    #: indices of requests whose tokens differ from the baseline (empty: verified)
    mismatched: list[int] = field(default_factory=list)
    #: wall seconds of every timed repeat; the other fields are the median repeat's (by wall time)
    wall_s_repeats: list[float] = field(default_factory=list)
    #: the degraded hook calls behind ``stats.degraded_events``, per connector and hook
    hook_failures: list[HookFailure] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return self.stats.steps

    @property
    def steps_per_s(self) -> float:
        """Of the median repeat."""
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_per_s_min(self) -> float:
        """The slowest repeat."""
        slowest = max(self.wall_s_repeats or [self.wall_s])
        return self.steps / slowest if slowest > 0 else 0.0

    @property
    def connector_ms_per_step(self) -> float:
        return 1e3 * self.connector_s / self.steps if self.steps else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of all prompt tokens that were loaded from a connector."""
        return self.stats.prompt_tokens_loaded / self.stats.prompt_tokens if self.stats.prompt_tokens else 0.0

    @property
    def verified(self) -> bool:
        return not self.mismatched

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "label": self.label,
            "connectors": list(self.connectors),
            **self.stats.as_dict(),
            "hit_rate": self.hit_rate,
            "wall_s": self.wall_s,
            "steps_per_s": self.steps_per_s,
            "steps_per_s_min": self.steps_per_s_min,
            "wall_s_repeats": self.wall_s_repeats,
            "connector_s": self.connector_s,
            "connector_ms_per_step": self.connector_ms_per_step,
            "output_verified": self.verified,
            "mismatched_requests": self.mismatched,
            "hook_failures": [asdict(f) for f in self.hook_failures],
        }
        if samples:
            doc["samples"] = [asdict(s) for s in self.samples]
        return doc


@dataclass
class Simulation:
    """A workload run without connectors (``baseline``) and with each setup (``runs``)."""

    workload: Workload
    options: EngineOptions
    reusable_tokens: int
    baseline: RunResult
    runs: list[RunResult]

    @property
    def verified(self) -> bool:
        """Every run produced exactly the baseline's tokens."""
        return all(run.verified for run in self.runs)

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        return {
            "workload": {
                "name": self.workload.name,
                "description": self.workload.description,
                "seed": self.workload.seed,
                "requests": len(self.workload.requests),
                "prompt_tokens": self.workload.num_prompt_tokens,
                "reusable_prompt_tokens": self.reusable_tokens,
            },
            "engine": {**asdict(self.options), "description": self.options.describe()},
            "baseline": self.baseline.to_dict(samples=samples),
            "runs": [run.to_dict(samples=samples) for run in self.runs],
            "output_verified": self.verified,
        }


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
    options: EngineOptions,
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
        **options.scheduler_options(),
    )
    timer = _HostTimer([engine.scheduler_host, engine.worker_host])
    requests = workload.requests
    handles: list[Request | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    samples: list[StepSample] = []
    stats = engine.stats
    clock = 0
    start = time.perf_counter()
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
    wall_s = time.perf_counter() - start
    outputs = [list(h.output_token_ids) if h is not None else [] for h in handles]
    # read engine.stats again: it sums the hosts' degraded events when read
    result = RunResult(label, setup.names if setup else (), engine.stats, wall_s, timer.total, samples, outputs)
    result.hook_failures = [
        HookFailure(name, hook, count, host.first_errors[name, hook])
        for host in (engine.scheduler_host, engine.worker_host)
        if host is not None
        for (name, hook), count in sorted(host.error_counts.items())
    ]
    return result


def _ready(after: int | None, handles: Sequence[Request | None]) -> bool:
    if after is None:
        return True
    dependency = handles[after]
    return dependency is not None and dependency.is_finished


def _preflight(setup: ConnectorSetup) -> None:
    """Load ``setup``'s connectors (import, config, API version) so a bad name fails before any run."""
    ConnectorHost.from_names(list(setup.names), role="scheduler", config=setup.config).shutdown()


def simulate(
    workload: Workload,
    setups: Sequence[ConnectorSetup],
    options: EngineOptions | None = None,
    *,
    on_progress: ProgressCallback | None = None,
    repeats: int = 3,
) -> Simulation:
    """Run ``workload`` without connectors and with each setup; compare every request's tokens.

    One untimed warm-up round, then ``repeats`` interleaved timed rounds (see
    the module docstring); a setup is verified only if every repeat produced
    the baseline's tokens. Connectors that cannot be loaded raise the SDK's
    errors (:class:`~kvconn.ConnectorNotFoundError`, ...) before anything runs long.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    options = options or EngineOptions()
    for setup in setups:
        _preflight(setup)
    order: list[ConnectorSetup | None] = [None, *setups]
    rounds: list[list[RunResult]] = [[] for _ in order]
    for r in range(1 + repeats):  # round 0: the warm-up, not kept
        for i in _rotated(range(len(order)), r):
            progress = _round_progress(on_progress, r, 1 + repeats)
            # A model name per round: a store that outlives its engine (mooncake's embedded one) starts
            # cold in every round, as the first round does, so rounds measure the same work.
            run = run_workload(workload, options, order[i], on_progress=progress, model=f"kvconn-reference@{r}")
            if r:
                rounds[i].append(run)
    baseline, *runs = (_merged(results) for results in rounds)
    for run, results in zip(runs, rounds[1:], strict=True):
        run.mismatched = sorted(
            {
                i
                for result in results
                for i, (a, b) in enumerate(zip(result.outputs, baseline.outputs, strict=True))
                if a != b
            }
        )
    reusable = reusable_prompt_tokens([r.prompt for r in workload.requests], options.block_size)
    return Simulation(workload, options, reusable, baseline, runs)


def _rotated(items: range, by: int) -> list[int]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def _round_progress(on_progress: ProgressCallback | None, round_: int, rounds: int) -> ProgressCallback | None:
    """Progress over all rounds: requests finished so far out of ``rounds`` times the workload."""
    if on_progress is None:
        return None
    report = on_progress

    def progress(label: str, finished: int, total: int) -> None:
        report(label, round_ * total + finished, rounds * total)

    return progress


def _merged(results: list[RunResult]) -> RunResult:
    """One setup's timed repeats as one result: the median repeat (by wall time), with every repeat's times."""
    median = statistics.median_low(r.wall_s for r in results)
    chosen = next(r for r in results if r.wall_s == median)
    chosen.wall_s_repeats = [r.wall_s for r in results]
    return chosen
