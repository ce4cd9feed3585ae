"""``kvconn_cli.measure``: side-by-side timed rounds, medians, fault totals and output verification."""

from __future__ import annotations

import gc
import itertools
import statistics
from collections import defaultdict
from typing import Any

import msgspec
import pytest

from kvconn import ConnectorNotFoundError, ConnectorRequest, KVConnector, KVConnectorMetadata
from kvconn.reference.simulate import SIMULATE_SHAPE, ConnectorSetup, RunResult, run_workload
from kvconn.reference.workloads import make_workload
from kvconn.testing.raw_hook_connector import HookReferenceConfig, HookReferenceConnector, fresh_namespace
from kvconn_cli.measure import simulate
from kvconn_cli.rounds import Clock

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
NO_LOCAL_CACHE = SIMULATE_SHAPE.replace(enable_prefix_caching=False)


class LyingConnector(KVConnector):
    """Claims every prefix is stored but never writes a byte: a load that is silently wrong."""

    loads = True

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return len(request.block_hashes) * self.context.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: ConnectorRequest, num_external_tokens: int) -> None:
        """Accepts the load (and then does nothing with it)."""

    def build_connector_meta(self, scheduler_output: object, block_state: object) -> KVConnectorMetadata:
        return KVConnectorMetadata()


#: The model name of the warm-up round's engines (round 0, pass 0): every pass names its own.
WARM_UP_MODEL = "kvconn-reference@0.0"


class DownInTheWarmUpConnector(HookReferenceConnector):
    """A store that is down during the warm-up round only: its loads fail and ``request_finished`` raises there."""

    def __init__(self, config: HookReferenceConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if self.context.model == WARM_UP_MODEL:
            self.config = msgspec.structs.replace(self.config, fail_from_block=0, fail_hook="request_finished")
            self.request_finished = self._injected_failure  # type: ignore[method-assign,assignment]


class LyingInTheWarmUpConnector(LyingConnector):
    """Lies (claims every prefix, writes nothing) during the warm-up round only, and claims nothing later."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if self.context.model != WARM_UP_MODEL:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


def test_a_saving_connector_loads_what_the_baseline_computes_and_matches_its_output() -> None:
    workload = make_workload("shared-prefix", 12, seed=3)
    sim = simulate(workload, [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE, min_round_s=0)
    base, run = sim.baseline, sim.runs[0]
    assert sim.verified and run.verified and run.outputs == base.outputs and all(run.outputs)
    assert base.stats.prompt_tokens_loaded == 0 and base.connector_s == 0.0
    assert 0 < run.stats.prompt_tokens_loaded <= sim.reusable_tokens
    assert run.stats.prompt_tokens_computed == base.stats.prompt_tokens_computed - run.stats.prompt_tokens_loaded
    assert run.hit_rate == run.stats.prompt_tokens_loaded / workload.num_prompt_tokens
    assert run.connector_s > 0 and run.connector_ms_per_step > 0
    # per-step samples add up to the engine's cumulative counters
    assert len(run.samples) == run.steps
    assert sum(s.prompt_tokens_loaded for s in run.samples) == run.stats.prompt_tokens_loaded
    assert sum(s.prompt_tokens_computed for s in run.samples) == run.stats.prompt_tokens_computed
    assert sum(s.connector_s for s in run.samples) == pytest.approx(run.connector_s)
    assert run.samples[-1].requests_finished == len(workload.requests)
    doc = sim.to_dict()
    assert doc["output_verified"] is True and doc["runs"][0]["prompt_tokens_loaded"] == run.stats.prompt_tokens_loaded


def test_faults_of_every_round_are_counted_the_warm_up_included() -> None:
    workload = make_workload("shared-prefix", 6, seed=0)

    def down() -> ConnectorSetup:  # in a store namespace of its own: the runs must not share blocks
        return ConnectorSetup((f"{__name__}:DownInTheWarmUpConnector",), fresh_namespace("down"))

    warm_up_alone = run_workload(workload, NO_LOCAL_CACHE, down(), model=WARM_UP_MODEL)  # what the warm-up does
    assert warm_up_alone.stats.failed_load_blocks > 0 and warm_up_alone.hook_failures
    sim = simulate(workload, [down()], NO_LOCAL_CACHE, repeats=2, min_round_s=0)
    run = sim.runs[0]
    assert run.stats.failed_load_blocks == warm_up_alone.stats.failed_load_blocks
    assert run.stats.degraded_events == warm_up_alone.stats.degraded_events > 0
    assert run.hook_failures == warm_up_alone.hook_failures
    assert run.fault_passes == 3  # the warm-up and two timed rounds of one pass
    assert run.hook_failures[0].hook == "request_finished" and "injected failure" in run.hook_failures[0].first_error
    doc = sim.to_dict()["runs"][0]
    assert doc["failed_load_blocks"] == run.stats.failed_load_blocks and doc["fault_passes"] == 3
    assert doc["hook_failures"][0]["count"] == run.hook_failures[0].count
    assert sim.verified  # failed loads were recomputed: faults, not wrong tokens


def test_fault_counts_add_up_every_pass_of_every_round() -> None:
    workload = make_workload("shared-prefix", 2, seed=0)
    failing = ConnectorSetup((MEMORY,), {"fail_hook": "save_kv_layer"})
    one_pass = run_workload(workload, NO_LOCAL_CACHE, failing)
    sim = simulate(workload, [failing], NO_LOCAL_CACHE, repeats=2, min_round_s=0)
    run = sim.runs[0]
    assert run.stats.degraded_events == 3 * one_pass.stats.degraded_events > 0
    (failure,) = run.hook_failures
    assert failure.count == 3 * one_pass.hook_failures[0].count
    assert run.stats.prompt_tokens_computed == one_pass.stats.prompt_tokens_computed  # a pass's, not summed


def test_a_wrong_load_in_the_warm_up_round_is_a_mismatch() -> None:
    sim = simulate(
        make_workload("shared-prefix", 6, seed=0),
        [ConnectorSetup((f"{__name__}:LyingInTheWarmUpConnector",))],
        NO_LOCAL_CACHE,
        min_round_s=0,
    )
    assert not sim.verified and sim.runs[0].mismatched


def test_a_wrong_load_is_reported_as_a_mismatch() -> None:
    workload = make_workload("shared-prefix", 6, seed=0)
    sim = simulate(workload, [ConnectorSetup((f"{__name__}:LyingConnector",))], NO_LOCAL_CACHE, min_round_s=0)
    run = sim.runs[0]
    assert run.stats.prompt_tokens_loaded > 0
    assert not sim.verified and run.mismatched
    assert sim.to_dict()["runs"][0]["mismatched_requests"] == run.mismatched


def test_several_connectors_run_together_in_one_host() -> None:
    sim = simulate(
        make_workload("long-document", 4, seed=0), [ConnectorSetup((MEMORY, "dummy"))], NO_LOCAL_CACHE, min_round_s=0
    )
    assert sim.runs[0].label == f"{MEMORY}+dummy"
    assert sim.verified and sim.runs[0].stats.prompt_tokens_loaded > 0


def test_an_unknown_connector_fails_before_any_run() -> None:
    calls: list[str] = []
    with pytest.raises(ConnectorNotFoundError):
        simulate(
            make_workload("multi-turn", 2), [ConnectorSetup(("no-such",))], on_progress=lambda *a: calls.append(a[0])
        )
    assert calls == []


def test_timed_rounds_follow_one_warm_up_round_and_rotate_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvconn_cli.measure as sim_module

    order: list[str] = []

    def recording(*args: object, **kwargs: object) -> object:
        result = run_workload(*args, **kwargs)  # type: ignore[arg-type]
        order.append(result.label)
        return result

    monkeypatch.setattr(sim_module, "run_workload", recording)
    sim = simulate(
        make_workload("shared-prefix", 4, seed=1), [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE, repeats=3, min_round_s=0
    )
    label = "kvconn.testing.memory_connector:MemoryConnector"
    # round 0 is the warm-up; the baseline does not always go first
    assert order == ["no connector", label, label, "no connector", "no connector", label, label, "no connector"]
    for run in (sim.baseline, *sim.runs):
        assert len(run.wall_s_repeats) == 3 and [r.passes for r in run.rounds] == [1, 1, 1]
        assert run.steps_per_s_min <= run.steps_per_s <= run.steps_per_s_max
    assert sim.verified


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_a_round_repeats_the_workload_until_each_run_has_spent_its_minimum(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    import kvconn_cli.measure as sim_module

    passes: dict[tuple[str, int], list[RunResult]] = defaultdict(list)  # (label, round) -> passes, in order
    turns: list[tuple[int, str]] = []

    def recording(*args: Any, model: str, **kwargs: Any) -> RunResult:
        result = run_workload(*args, model=model, **kwargs)
        round_ = int(model.split("@")[1].split(".")[0])
        passes[result.label, round_].append(result)
        turns.append((round_, result.label))
        return result

    monkeypatch.setattr(sim_module, "run_workload", recording)
    minimum = 0.05
    workload = make_workload("shared-prefix", 4, seed=1)
    sim = simulate(workload, [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE, repeats=2, clock=clock, min_round_s=minimum)
    for run in (sim.baseline, *sim.runs):
        assert len(passes[run.label, 0]) == 1  # the warm-up round: one pass each
        assert len(run.rounds) == 2
        for round_, timed in enumerate(run.rounds, start=1):
            spent = [p.cpu_s if clock == "cpu" else p.wall_s for p in passes[run.label, round_]]
            assert timed.passes == len(spent) >= 1
            assert timed.seconds(clock) == pytest.approx(sum(spent)) and sum(spent) >= minimum
            assert sum(spent[:-1]) < minimum  # it stopped at the pass that reached the minimum
            assert timed.steps == sum(p.steps for p in passes[run.label, round_])
    # passes take turns: while both runs are short of the minimum, neither runs twice in a row
    round_1 = [label for round_, label in turns if round_ == 1]
    both = 2 * min(round_1.count(label) for label in set(round_1))
    assert all(a != b for a, b in itertools.pairwise(round_1[:both]))
    assert sim.verified and sim.timing.clock == clock and sim.timing.min_round_s == minimum


def test_timed_rounds_run_with_the_warm_heap_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full GC collection of the whole heap costs as much as a pass: timed passes must not pay for it."""
    import kvconn_cli.measure as sim_module

    frozen: list[tuple[str, bool]] = []

    def recording(*args: Any, model: str, **kwargs: Any) -> RunResult:
        frozen.append((model.split(".")[0], gc.get_freeze_count() > 0))
        return run_workload(*args, model=model, **kwargs)

    monkeypatch.setattr(sim_module, "run_workload", recording)
    simulate(make_workload("shared-prefix", 2, seed=0), [], NO_LOCAL_CACHE, repeats=2, min_round_s=0)
    assert frozen == [("kvconn-reference@0", False), ("kvconn-reference@1", True), ("kvconn-reference@2", True)]
    assert gc.get_freeze_count() == 0  # unfrozen afterwards


def test_figures_are_min_median_max_of_the_rounds_by_the_clock() -> None:
    workload = make_workload("shared-prefix", 4, seed=1)
    sim = simulate(workload, [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE, repeats=4, min_round_s=0.02)
    run = sim.baseline
    by_cpu = [r.steps / r.cpu_s for r in run.rounds]
    assert run.steps_per_s_repeats == by_cpu
    assert run.steps_per_s == statistics.median_low(by_cpu)
    assert (run.steps_per_s_min, run.steps_per_s_max) == (min(by_cpu), max(by_cpu))
    assert run.steps_per_s_spread == (min(by_cpu) / run.steps_per_s - 1, max(by_cpu) / run.steps_per_s - 1)
    assert run.steps_per_s_wall == statistics.median_low(r.steps / r.wall_s for r in run.rounds)
    # the result's times are the median round's, per pass
    median = run.rounds[by_cpu.index(run.steps_per_s)]
    assert run.cpu_s == median.cpu_s / median.passes and run.wall_s == median.wall_s / median.passes
    doc = sim.to_dict()
    assert doc["timing"]["clock"] == "cpu" and doc["timing"]["repeats"] == 4 and doc["timing"]["torch_threads"] == 1
    assert "CPU time of this process" in doc["timing"]["description"]
    base = doc["baseline"]
    assert base["clock"] == "cpu" and base["steps_per_s"] == run.steps_per_s and len(base["rounds"]) == 4
    assert base["steps_per_s_repeats"] == by_cpu and base["wall_s_repeats"] == run.wall_s_repeats
    # a connector's steps/s relative to the baseline's: the median of their ratios round by round
    ratios = [r.steps / r.cpu_s / (b.steps / b.cpu_s) for r, b in zip(sim.runs[0].rounds, run.rounds, strict=True)]
    assert sim.relative_steps_per_s(sim.runs[0]) == statistics.median_low(ratios)
    assert doc["runs"][0]["steps_per_s_vs_baseline"] == statistics.median_low(ratios)


def test_a_single_pass_is_its_own_round_timed_by_wall_clock() -> None:
    # Was a bare run_workload pass, which carried round figures; a pass is the SDK's now, rounds the CLI's.
    workload = make_workload("shared-prefix", 2, seed=0)
    run = simulate(workload, [], NO_LOCAL_CACHE, repeats=1, clock="wall", min_round_s=0).baseline
    assert run.clock == "wall" and len(run.rounds) == 1 and run.rounds[0].passes == 1 and run.cpu_s > 0
    assert run.steps_per_s == run.steps_per_s_min == run.steps_per_s_max == run.steps / run.wall_s
    assert run.wall_s_repeats == [run.wall_s] and run.steps_per_s_spread == (0.0, 0.0)


def test_a_bad_clock_or_round_length_is_refused() -> None:
    workload = make_workload("shared-prefix", 2, seed=0)
    with pytest.raises(ValueError, match="clock must be one of cpu, wall, got 'gpu'"):
        simulate(workload, [], clock="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_round_s must be >= 0 seconds, got -1"):
        simulate(workload, [], min_round_s=-1)
