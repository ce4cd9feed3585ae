"""How ``kvconn simulate`` measures: timed rounds of workload passes without and with connectors, and medians.

:func:`simulate` runs one :class:`~kvconn.reference.workloads.Workload` on a
connector-less reference engine (the baseline) and then once per connector
setup, with the same engine options, through the SDK's driver
(:func:`kvconn.reference.simulate.run_workload`: one pass, its counters,
per-step samples, connector time and generated tokens). Every request's
generated tokens are compared with the baseline's: the reference model's next
token depends on the KV it reads, so a wrong or stale load shows up as a
mismatch.

Timings are fair on a shared machine: one untimed warm-up round runs the
baseline and every setup once (imports, first calls of torch at each size),
then ``repeats`` timed rounds run them all in turn, the order rotated each
round, so a slow spell lands on every run alike and no run always goes first
(:func:`kvconn_cli.rounds.interleaved_rounds`, the benchmarks' timer too).
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

The command imports this module when it runs, not for ``--help``: the
option defaults it shares live in :mod:`kvconn_cli.rounds`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, get_args

from kvconn.reference.shape import EngineShape
from kvconn.reference.simulate import (
    SIMULATE_SHAPE,
    ConnectorSetup,
    HookFailure,
    ProgressCallback,
    RunResult,
    check_setup,
    run_workload,
)
from kvconn.reference.workloads import Workload, reusable_prompt_tokens

from .rounds import CLOCKS, DEFAULT_MIN_ROUND_S, Clock, interleaved_rounds

__all__ = [
    "FAULT_COUNTERS",
    "MeasuredRun",
    "Simulation",
    "TimedRound",
    "Timing",
    "describe_local_cache",
    "simulate",
]

#: The :class:`~kvconn.reference.EngineStats` counters of faults: a measured run sums them over every pass it ran.
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
class MeasuredRun(RunResult):
    """One run measured over timed rounds: a pass of the median round, with every round's figures.

    Counters, samples and outputs are one pass's of the median round (by
    ``clock``), except the faults (:data:`FAULT_COUNTERS` and
    ``hook_failures``), which are summed over every pass of every round, the
    warm-up's included (``fault_passes``); ``wall_s``, ``cpu_s`` and
    ``connector_s`` are the median round's means per pass.
    """

    #: indices of requests whose tokens differ from the baseline in any pass (empty: verified)
    mismatched: list[int] = field(default_factory=list)
    #: the clock of the steps/s figures
    clock: Clock = "cpu"
    #: every timed round, in order (at least one)
    rounds: list[TimedRound] = field(default_factory=list)
    #: the passes ``hook_failures`` and the stats' :data:`FAULT_COUNTERS` add up: every pass of every round,
    #: the untimed warm-up's included
    fault_passes: int = 1

    @property
    def steps_per_s_repeats(self) -> list[float]:
        """Every round's steps/s by ``clock``, in round order."""
        return [r.steps_per_s(self.clock) for r in self.rounds]

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
        return statistics.median_low(r.steps_per_s("wall") for r in self.rounds)

    @property
    def wall_s_repeats(self) -> list[float]:
        """Every round's wall seconds per pass (with ``steps``: the round's steps/s by wall time)."""
        return [r.wall_s / r.passes for r in self.rounds]

    @property
    def verified(self) -> bool:
        return not self.mismatched

    def to_dict(self, *, samples: bool = False) -> dict[str, Any]:
        """The run's object in ``kvconn simulate --json``: the pass's figures with the rounds' and the verdict."""
        rounds: dict[str, Any] = {
            "clock": self.clock,
            "steps_per_s": self.steps_per_s,
            "steps_per_s_min": self.steps_per_s_min,
            "steps_per_s_max": self.steps_per_s_max,
            "steps_per_s_spread": list(self.steps_per_s_spread),
            "steps_per_s_repeats": self.steps_per_s_repeats,
            "steps_per_s_wall": self.steps_per_s_wall,
            "wall_s_repeats": self.wall_s_repeats,
            "rounds": [asdict(r) for r in self.rounds],
        }
        verdict: dict[str, Any] = {"output_verified": self.verified, "mismatched_requests": self.mismatched}
        # after which of the pass's keys (RunResult.to_dict) each group goes: the order the report always had
        after: dict[str, dict[str, Any]] = {
            "cpu_s": rounds,
            "connector_ms_per_step": verdict,
            "hook_failures": {"fault_passes": self.fault_passes},
        }
        doc: dict[str, Any] = {}
        for key, value in super().to_dict(samples=samples).items():
            doc[key] = value
            doc.update(after.get(key, {}))
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
    baseline: MeasuredRun
    runs: list[MeasuredRun]
    timing: Timing

    @property
    def verified(self) -> bool:
        """Every run produced exactly the baseline's tokens."""
        return all(run.verified for run in self.runs)

    def relative_steps_per_s(self, run: MeasuredRun) -> float:
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
        """The document of ``kvconn simulate --json`` (less its ``schema_version``)."""
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
        check_setup(setup)
    passes = functools.partial(_passes, workload, shape, [None, *setups], clock, on_progress, 1 + repeats)
    warm_up = [rounds[0] for rounds in passes(range(1), 0.0)]  # untimed, one pass each; its faults are kept
    with _gc_frozen():
        timed = passes(range(1, 1 + repeats), min_round_s)
    baseline, *runs = (_merged(run_rounds, clock, warm) for run_rounds, warm in zip(timed, warm_up, strict=True))
    for run, run_rounds, warm in zip(runs, timed[1:], warm_up[1:], strict=True):
        run.mismatched = sorted(
            {
                i
                for run_passes in (warm, *run_rounds)
                for result in run_passes
                for i, (a, b) in enumerate(zip(result.outputs, baseline.outputs, strict=True))
                if a != b
            }
        )
    reusable = reusable_prompt_tokens([r.prompt for r in workload.requests], shape.block_size)
    return Simulation(workload, shape, reusable, baseline, runs, Timing(clock, repeats, min_round_s, _torch_threads()))


def _passes(
    workload: Workload,
    shape: EngineShape,
    order: Sequence[ConnectorSetup | None],
    clock: Clock,
    on_progress: ProgressCallback | None,
    num_rounds: int,
    rounds: range,
    min_s: float,
) -> list[list[list[RunResult]]]:
    """Every run's passes in ``rounds`` (``[run][round][pass]``, runs in ``order``), the runs taking turns.

    Each round goes on until every run has spent ``min_s`` by ``clock``, by
    the passes' own times (taken around the workload, the engine's set-up
    left out); see :func:`~kvconn_cli.rounds.interleaved_rounds`.
    """

    def one_pass(run: int, round_: int, sweep: int) -> RunResult:
        # A model name per pass: a store that outlives its engine (mooncake's embedded one) starts
        # cold in every pass, as the first one does, so passes measure the same work.
        progress = _round_progress(on_progress, round_, num_rounds)
        return run_workload(
            workload, shape, order[run], on_progress=progress, model=f"kvconn-reference@{round_}.{sweep}"
        )

    def spent(result: RunResult) -> float:
        return result.cpu_s if clock == "cpu" else result.wall_s

    return interleaved_rounds(one_pass, len(order), rounds, seconds=spent, min_s=min_s)


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


def _round_progress(on_progress: ProgressCallback | None, round_: int, rounds: int) -> ProgressCallback | None:
    """Progress over all rounds: requests finished so far out of ``rounds`` times the workload (per pass)."""
    if on_progress is None:
        return None
    report = on_progress

    def progress(label: str, finished: int, total: int) -> None:
        report(label, round_ * total + finished, rounds * total)

    return progress


def _merged(rounds: list[list[RunResult]], clock: Clock, warm_up: list[RunResult]) -> MeasuredRun:
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
    return MeasuredRun(
        label=shown.label,
        connectors=shown.connectors,
        stats=replace(shown.stats, **faults),
        wall_s=chosen.wall_s / chosen.passes,
        connector_s=chosen.connector_s / chosen.passes,
        samples=shown.samples,
        outputs=shown.outputs,
        hook_failures=_summed_failures(every_pass),
        cpu_s=chosen.cpu_s / chosen.passes,
        clock=clock,
        rounds=timed,
        fault_passes=len(every_pass),
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
