"""``kvconn_cli.rounds.interleaved_rounds``: the turn order and round ends that simulate and the benchmarks share."""

from __future__ import annotations

import pytest

from kvconn_cli.rounds import interleaved_rounds


def test_every_run_takes_one_turn_per_round_starting_at_the_round_number() -> None:
    calls: list[tuple[int, int, int]] = []

    def turn(run: int, round_: int, sweep: int) -> str:
        calls.append((run, round_, sweep))
        return f"{run}/{round_}"

    results = interleaved_rounds(turn, 3, range(1, 5), seconds=lambda _: 1.0)
    assert [run for run, _, _ in calls] == [1, 2, 0, 2, 0, 1, 0, 1, 2, 1, 2, 0]  # rotated, wrapping round
    assert {sweep for _, _, sweep in calls} == {0}  # min_s=0: one turn each
    assert results == [[[f"{run}/{r}"] for r in range(1, 5)] for run in range(3)]  # [run][round][turn]


def test_a_round_goes_on_until_every_run_has_spent_its_minimum() -> None:
    cost = {0: 0.3, 1: 1.0}  # run 0 needs four turns to reach 1.0 s, run 1 one
    calls: list[tuple[int, int]] = []

    def turn(run: int, round_: int, sweep: int) -> float:
        calls.append((run, sweep))
        return cost[run]

    (run_0, run_1) = interleaved_rounds(turn, 2, range(1), seconds=float, min_s=1.0)
    assert run_0 == [[0.3] * 4] and run_1 == [[1.0]]
    # the runs take turns while both are due; run 1 drops out once it has reached the minimum
    assert calls == [(0, 0), (1, 0), (0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize("runs", [0, 1])
def test_no_run_or_one_run(runs: int) -> None:
    results = interleaved_rounds(lambda run, round_, sweep: round_, runs, range(3), seconds=float)
    assert results == [[[0], [1], [2]]] * runs
