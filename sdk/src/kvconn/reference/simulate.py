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
Within a round the workload runs again and again (*passes*, interleaved
across the runs) until each run has spent ``min_round_s`` by the round's
clock: one pass of a small workload lasts a few scheduler time slices, so
winning or losing one slice would move its figure by a third. The heap is
frozen for the timed rounds (:func:`gc.freeze` after the warm-up): a full
collection of the warm heap costs as much as a pass and would land on
whichever run happened to allocate.

The clock is the process's CPU time by default (``"cpu"``: every thread of
this process, connectors' threads included; the reference worker sets torch
to one intra-op thread, so no idle thread spins into it). On a machine whose
cores other work holds, wall time measures the share of the CPU this process
was given; CPU time measures the work. It leaves out time spent waiting on
other processes (a remote store, I/O): ``"wall"`` includes it, and the wall
figures are reported beside either way. steps/s is reported for every round,
with the median round's, the slowest and the fastest; the other figures are
the median round's.

The engine options matter: with a large local prefix cache the connector has
nothing to do. :data:`SIMULATE_SHAPE` is a local prefix cache that
holds only a fraction of the workload's prefixes, as in real serving, where
the GPU cache is much smaller than the working set.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, get_args

from ..host import STEP_CALLS, CallOutcome, ConnectorHost
from .engine import Engine
from .request import Request
from .shape import EngineShape
from .stats import EngineStats
from .workloads import Workload, reusable_prompt_tokens

__all__ = [
    "CLOCKS",
    "DEFAULT_MIN_ROUND_S",
    "FAULT_COUNTERS",
    "HOST_CALLS",
    "SIMULATE_SHAPE",
    "Clock",
    "ConnectorSetup",
    "HookFailure",
    "RunResult",
    "Simulation",
    "StepSample",
    "TimedRound",
    "Timing",
    "describe_local_cache",
    "run_workload",
    "simulate",
]

#: The ``ConnectorHost`` methods an engine calls per step; connector time is measured around them.
HOST_CALLS = STEP_CALLS

ProgressCallback = Callable[[str, int, int], None]

#: What a round is timed by: the process's CPU time or wall-clock time.
Clock = Literal["cpu", "wall"]
#: The clocks, and what each counts (reports say it).
CLOCKS: Mapping[Clock, str] = {
    "cpu": "CPU time of this process (all its threads, not time spent waiting on other processes)",
    "wall": "wall-clock time (includes time this process waited for a core)",
}
#: A timed round lasts at least this long per run, by its clock: many scheduler time slices.
DEFAULT_MIN_ROUND_S = 1.0


#: The engine every simulation runs unless told otherwise: a local (GPU-side) pool of 256 blocks that
#: running requests and the local prefix cache share, so local prefix hits are evicted and a connector can
#: serve them again; a few requests at a time.
SIMULATE_SHAPE = EngineShape(num_blocks=256, max_num_batched_tokens=1024, max_num_seqs=4)
#: The :class:`EngineStats` counters of faults: a simulation's result sums them over every pass it ran.
FAULT_COUNTERS = ("degraded_events", "failed_load_blocks")
#: The shape fields a simulation reports (its JSON ``engine`` object).
_REPORTED_FIELDS = ("block_size", "num_blocks", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs")


def describe_local_cache(shape: EngineShape) -> str:
    """One line saying what the local cache can hold (what the connector competes with)."""
    if not shape.enable_prefix_caching:
        return "local prefix cache: off (every prefix hit must come from a connector)"
    return (
        f"local prefix cache: {shape.num_blocks} blocks x {shape.block_size} tokens "
        f"({shape.num_blocks * shape.block_size} tokens, shared with running requests)"
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


@dataclass(frozen=True)
class TimedRound:
    """One run's share of a timed round: ``passes`` runs of the workload and their summed steps and times."""

    passes: int
    steps: int
    wall_s: float
    cpu_s: float
    connector_s: float

    def seconds(self, clock: Clock) -> float:
        return self.cpu_s if clock == "cpu" else self.wall_s

    def steps_per_s(self, clock: Clock) -> float:
        seconds = self.seconds(clock)
        return self.steps / seconds if seconds > 0 else 0.0


@dataclass
class RunResult:
    """One run of the workload: counters, timings, per-step samples and outputs.

    From :func:`run_workload`: one pass. From :func:`simulate`: counters,
    samples and outputs are one pass's of the median round (by ``clock``),
    except the faults (:data:`FAULT_COUNTERS` and ``hook_failures``), which
    are summed over every pass of every round, the warm-up's included
    (``fault_passes``); ``wall_s``, ``cpu_s`` and ``connector_s`` are the
    median round's means per pass; ``rounds`` holds every timed round.
    """

    label: str
    connectors: tuple[str, ...]
    stats: EngineStats
    wall_s: float
    connector_s: float
    samples: list[StepSample]
    outputs: list[list[int]]
    #: indices of requests whose tokens differ from the baseline (empty: verified)
    mismatched: list[int] = field(default_factory=list)
    #: the degraded hook calls behind ``stats.degraded_events``, per connector and hook
    hook_failures: list[HookFailure] = field(default_factory=list)
    #: CPU seconds of this process while the workload ran (see ``wall_s``)
    cpu_s: float = 0.0
    #: the clock of the steps/s figures
    clock: Clock = "wall"
    #: every timed round, in order (empty: this result is one pass, its own only round)
    rounds: list[TimedRound] = field(default_factory=list)
    #: the passes ``hook_failures`` and the stats' :data:`FAULT_COUNTERS` add up: every pass of every round
    #: (the untimed warm-up's included) from :func:`simulate`, 1 from :func:`run_workload`
    fault_passes: int = 1

    @property
    def steps(self) -> int:
        return self.stats.steps

    def _rounds(self) -> list[TimedRound]:
        return self.rounds or [TimedRound(1, self.steps, self.wall_s, self.cpu_s, self.connector_s)]

    @property
    def steps_per_s_repeats(self) -> list[float]:
        """Every round's steps/s by ``clock``, in round order."""
        return [r.steps_per_s(self.clock) for r in self._rounds()]

    @property
    def steps_per_s(self) -> float:
        """Of the median round (the lower middle one of an even count), by ``clock``."""
        return statistics.median_low(self.steps_per_s_repeats)

    @property
    def steps_per_s_min(self) -> float:
        """The slowest round."""
        return min(self.steps_per_s_repeats)

    @property
    def steps_per_s_max(self) -> float:
        """The fastest round."""
        return max(self.steps_per_s_repeats)

    @property
    def steps_per_s_spread(self) -> tuple[float, float]:
        """The slowest and the fastest round relative to the median: ``(-0.05, 0.08)`` is -5% / +8%."""
        median = self.steps_per_s
        if median <= 0:
            return 0.0, 0.0
        return self.steps_per_s_min / median - 1, self.steps_per_s_max / median - 1

    @property
    def steps_per_s_wall(self) -> float:
        """Of the median round by wall time (equal to ``steps_per_s`` when that is the clock)."""
        return statistics.median_low(r.steps_per_s("wall") for r in self._rounds())

    @property
    def wall_s_repeats(self) -> list[float]:
        """Every round's wall seconds per pass (with ``steps``: the round's steps/s by wall time)."""
        return [r.wall_s / r.passes for r in self._rounds()]

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
            "cpu_s": self.cpu_s,
            "clock": self.clock,
            "steps_per_s": self.steps_per_s,
            "steps_per_s_min": self.steps_per_s_min,
            "steps_per_s_max": self.steps_per_s_max,
            "steps_per_s_spread": list(self.steps_per_s_spread),
            "steps_per_s_repeats": self.steps_per_s_repeats,
            "steps_per_s_wall": self.steps_per_s_wall,
            "wall_s_repeats": self.wall_s_repeats,
            "rounds": [asdict(r) for r in self._rounds()],
            "connector_s": self.connector_s,
            "connector_ms_per_step": self.connector_ms_per_step,
            "output_verified": self.verified,
            "mismatched_requests": self.mismatched,
            "hook_failures": [asdict(f) for f in self.hook_failures],
            "fault_passes": self.fault_passes,
        }
        if samples:
            doc["samples"] = [asdict(s) for s in self.samples]
        return doc


@dataclass(frozen=True)
class Timing:
    """How a simulation timed its runs: the clock, the timed rounds and their least length."""

    clock: Clock
    repeats: int
    min_round_s: float
    #: torch's intra-op threads during the runs (the reference worker sets them; see ``CLOCKS``)
    torch_threads: int

    def describe(self) -> str:
        return (
            f"{self.repeats} timed rounds after one warm-up round, every run in turn; a round repeats the "
            f"workload until each run has spent {self.min_round_s:g} s; clock: {CLOCKS[self.clock]}; "
            f"torch threads: {self.torch_threads}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "warm_up_rounds": 1, "description": self.describe()}


@dataclass
class Simulation:
    """A workload run without connectors (``baseline``) and with each setup (``runs``)."""

    workload: Workload
    shape: EngineShape
    reusable_tokens: int
    baseline: RunResult
    runs: list[RunResult]
    timing: Timing

    @property
    def verified(self) -> bool:
        """Every run produced exactly the baseline's tokens."""
        return all(run.verified for run in self.runs)

    def relative_steps_per_s(self, run: RunResult) -> float:
        """``run``'s steps/s over the baseline's, of the median round: both measured in the same rounds.

        Round by round (the runs took turns within each), so a slow spell of
        the machine cancels out of the ratio.
        """
        ratios = [
            r.steps_per_s(self.timing.clock) / b.steps_per_s(self.timing.clock)
            for r, b in zip(run.rounds, self.baseline.rounds, strict=True)
        ]
        return statistics.median_low(ratios)

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
            "engine": {
                **{field: getattr(self.shape, field) for field in _REPORTED_FIELDS},
                "description": describe_local_cache(self.shape),
            },
            "timing": self.timing.to_dict(),
            "baseline": self.baseline.to_dict(samples=samples),
            "runs": [
                {**run.to_dict(samples=samples), "steps_per_s_vs_baseline": self.relative_steps_per_s(run)}
                for run in self.runs
            ],
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
    # read engine.stats again: it sums the hosts' degraded events when read
    result = RunResult(label, setup.names if setup else (), engine.stats, wall_s, timer.total, samples, outputs)
    result.cpu_s = cpu_s
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
    shape: EngineShape = SIMULATE_SHAPE,
    *,
    on_progress: ProgressCallback | None = None,
    repeats: int = 3,
    clock: Clock = "cpu",
    min_round_s: float = DEFAULT_MIN_ROUND_S,
) -> Simulation:
    """Run ``workload`` without connectors and with each setup; compare every request's tokens.

    One untimed warm-up round (one pass each), then ``repeats`` interleaved
    timed rounds in which every run repeats the workload until it has spent
    ``min_round_s`` by ``clock`` (at least one pass; ``0``: exactly one); see
    the module docstring. A setup is verified only if every pass of every
    round, the warm-up's included, produced the baseline's tokens, and its
    faults are counted over all of them. Connectors that cannot be
    loaded raise the SDK's errors (:class:`~kvconn.ConnectorNotFoundError`,
    ...) before anything runs long.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {', '.join(get_args(Clock))}, got {clock!r}")
    if not min_round_s >= 0:
        raise ValueError(f"min_round_s must be >= 0 seconds, got {min_round_s}")
    for setup in setups:
        _preflight(setup)
    order: list[ConnectorSetup | None] = [None, *setups]
    warm_up = _round(workload, shape, order, 0, clock, 0.0, on_progress, 1 + repeats)  # untimed, faults kept
    with _gc_frozen():
        timed = [
            _round(workload, shape, order, r, clock, min_round_s, on_progress, 1 + repeats)
            for r in range(1, 1 + repeats)
        ]
    rounds = [list(run_rounds) for run_rounds in zip(*timed, strict=True)]  # per run: every timed round's passes
    baseline, *runs = (_merged(run_rounds, clock, warm) for run_rounds, warm in zip(rounds, warm_up, strict=True))
    for run, run_rounds, warm in zip(runs, rounds[1:], warm_up[1:], strict=True):
        run.mismatched = sorted(
            {
                i
                for passes in (warm, *run_rounds)
                for result in passes
                for i, (a, b) in enumerate(zip(result.outputs, baseline.outputs, strict=True))
                if a != b
            }
        )
    reusable = reusable_prompt_tokens([r.prompt for r in workload.requests], shape.block_size)
    return Simulation(workload, shape, reusable, baseline, runs, Timing(clock, repeats, min_round_s, _torch_threads()))


def _round(
    workload: Workload,
    shape: EngineShape,
    order: Sequence[ConnectorSetup | None],
    round_: int,
    clock: Clock,
    min_s: float,
    on_progress: ProgressCallback | None,
    num_rounds: int,
) -> list[list[RunResult]]:
    """One round: passes of the workload, each run in turn, until every run has spent ``min_s`` by ``clock``.

    Returns every run's passes, in ``order``. The runs take turns pass by
    pass (order rotated by ``round_``), so a slow spell lands on all alike;
    a run that reached ``min_s`` drops out of the turns.
    """
    passes: list[list[RunResult]] = [[] for _ in order]
    spent = [0.0] * len(order)
    progress = _round_progress(on_progress, round_, num_rounds)
    turn = 0
    while due := [i for i in _rotated(range(len(order)), round_) if not passes[i] or spent[i] < min_s]:
        for i in due:
            # A model name per pass: a store that outlives its engine (mooncake's embedded one) starts
            # cold in every pass, as the first one does, so passes measure the same work.
            run = run_workload(
                workload, shape, order[i], on_progress=progress, model=f"kvconn-reference@{round_}.{turn}"
            )
            passes[i].append(run)
            spent[i] += run.cpu_s if clock == "cpu" else run.wall_s
        turn += 1
    return passes


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Collect, then freeze what is alive (modules, torch, the warm-up's state) for the timed rounds.

    A full collection of Python's cyclic GC scans every tracked object: with
    torch loaded that takes 60-80 ms, as long as a pass of the default
    workload, and it lands on whichever run allocates at that moment. Frozen,
    full collections scan only what the timed passes allocate. Nothing is
    frozen (or unfrozen) if the process had frozen objects already: that
    state is its own.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _torch_threads() -> int:
    import torch  # already imported by the reference worker

    return torch.get_num_threads()


def _rotated(items: range, by: int) -> list[int]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def _round_progress(on_progress: ProgressCallback | None, round_: int, rounds: int) -> ProgressCallback | None:
    """Progress over all rounds: requests finished so far out of ``rounds`` times the workload (per pass)."""
    if on_progress is None:
        return None
    report = on_progress

    def progress(label: str, finished: int, total: int) -> None:
        report(label, round_ * total + finished, rounds * total)

    return progress


def _merged(rounds: list[list[RunResult]], clock: Clock, warm_up: list[RunResult]) -> RunResult:
    """One run's timed rounds as one result: a pass of the median round (by ``clock``), every round's totals.

    The result's times are the median round's means per pass, so per-step
    figures (``connector_ms_per_step``) average over its passes. Its faults
    (:data:`FAULT_COUNTERS`, ``hook_failures``) are those of every pass, the
    ``warm_up`` round's included: a store that failed only there was not clean.
    """
    timed = [
        TimedRound(
            len(passes),
            sum(p.steps for p in passes),
            sum(p.wall_s for p in passes),
            sum(p.cpu_s for p in passes),
            sum(p.connector_s for p in passes),
        )
        for passes in rounds
    ]
    rates = [t.steps_per_s(clock) for t in timed]
    median = rates.index(statistics.median_low(rates))
    chosen = timed[median]
    every_pass = [*warm_up, *(p for passes in rounds for p in passes)]
    shown = rounds[median][0]
    faults = {name: sum(getattr(p.stats, name) for p in every_pass) for name in FAULT_COUNTERS}
    return replace(
        shown,
        stats=replace(shown.stats, **faults),
        hook_failures=_summed_failures(every_pass),
        fault_passes=len(every_pass),
        wall_s=chosen.wall_s / chosen.passes,
        cpu_s=chosen.cpu_s / chosen.passes,
        connector_s=chosen.connector_s / chosen.passes,
        clock=clock,
        rounds=timed,
    )


def _summed_failures(passes: Sequence[RunResult]) -> list[HookFailure]:
    """Every pass's hook failures, per (connector, hook): counts summed, the first error of the first pass."""
    summed: dict[tuple[str, str], HookFailure] = {}
    for result in passes:
        for failure in result.hook_failures:
            key = failure.connector, failure.hook
            seen = summed.get(key)
            summed[key] = failure if seen is None else replace(seen, count=seen.count + failure.count)
    return [summed[key] for key in sorted(summed)]
