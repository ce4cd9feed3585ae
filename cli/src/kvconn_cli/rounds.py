"""Interleaved rounds: the one timer of ``kvconn simulate`` and the benchmark scripts (``benchmarks/benchlib/``).

Both compare several things on a shared, noisy machine, so both time them
the same way: in rounds, every thing in turn within a round (the order
rotated each round, so no thing always goes first), so a slow spell of the
machine lands on all of them alike and round ``i`` of one can be set beside
round ``i`` of another. Within a round a thing takes turns until its turns
add up to a least length, so a unit of work that lasts only a few scheduler
time slices is not one slice more or less.

:func:`interleaved_rounds` decides the order and when a round ends; what one
turn does and how long it took are the caller's: ``kvconn simulate`` runs one
pass of a workload and reads the pass's own CPU or wall time (engine set-up
left out), a benchmark runs a calibrated batch of calls and reads its clock
around them.

Why here, a public module of the ``kvconn-cli`` distribution: the timer is a
measurement policy, which is tooling, and the SDK that connectors and engines
install carries none of it; the benchmark scripts already run under the CLI's
interpreter (``kvconn bench``, and every kvconn venv installs ``kvconn-cli``)
and import this module by its public name. It imports only the standard
library, so ``kvconn --help`` (the defaults of ``simulate``'s options live
here) and the benchmarks pay nothing for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal, TypeVar

__all__ = ["CLOCKS", "DEFAULT_MIN_ROUND_S", "Clock", "interleaved_rounds"]

T = TypeVar("T")

#: What a round is timed by: the process's CPU time or wall-clock time.
Clock = Literal["cpu", "wall"]
#: The clocks, and what each counts (reports say it).
CLOCKS: Mapping[Clock, str] = {
    "cpu": "CPU time of this process (all its threads, not time spent waiting on other processes)",
    "wall": "wall-clock time (includes time this process waited for a core)",
}
#: A timed round of ``kvconn simulate`` lasts at least this long per run, by its clock: many scheduler time slices.
DEFAULT_MIN_ROUND_S = 1.0


def interleaved_rounds(
    turn: Callable[[int, int, int], T],
    runs: int,
    rounds: Iterable[int],
    *,
    seconds: Callable[[T], float],
    min_s: float = 0.0,
) -> list[list[list[T]]]:
    """Every turn's result, per run and round (``[run][round][turn]``), of ``runs`` runs taking turns.

    ``rounds`` are the rounds' numbers (``range(1, 4)``: three rounds after a
    round 0 run by another call); round ``r`` starts at run ``r`` modulo
    ``runs`` and goes on in order, wrapping round. A round is sweeps: each
    sweep gives every run still due one turn, ``turn(run, round, sweep)``; a
    run is due until the ``seconds`` of its turns in the round add up to
    ``min_s``, and has at least one turn (``min_s=0``: exactly one). A run
    that reached ``min_s`` drops out of the sweeps while the others go on.
    """
    results: list[list[list[T]]] = [[] for _ in range(runs)]
    for round_ in rounds:
        turns: list[list[T]] = [[] for _ in range(runs)]
        spent = [0.0] * runs
        start = round_ % runs if runs else 0
        order = [*range(start, runs), *range(start)]
        sweep = 0
        while due := [i for i in order if not turns[i] or spent[i] < min_s]:
            for i in due:
                result = turn(i, round_, sweep)
                turns[i].append(result)
                spent[i] += seconds(result)
            sweep += 1
        for run, run_turns in zip(results, turns, strict=True):
            run.append(run_turns)
    return results
