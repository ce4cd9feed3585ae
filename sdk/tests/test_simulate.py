"""``kvconn.reference.simulate``: side-by-side runs, per-step samples, connector time and output verification."""

from __future__ import annotations

import pytest

from kvconn import ConnectorNotFoundError, ConnectorRequest, KVConnector, KVConnectorMetadata
from kvconn.reference.simulate import ConnectorSetup, EngineOptions, run_workload, simulate
from kvconn.reference.workloads import Workload, WorkloadRequest, make_workload

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
NO_LOCAL_CACHE = EngineOptions(enable_prefix_caching=False, num_blocks=256)


class LyingConnector(KVConnector):
    """Claims every prefix is stored but never writes a byte: a load that is silently wrong."""

    loads = True

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return len(request.block_hashes) * self.context.block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: ConnectorRequest, num_external_tokens: int) -> None:
        """Accepts the load (and then does nothing with it)."""

    def build_connector_meta(self, scheduler_output: object, block_state: object) -> KVConnectorMetadata:
        return KVConnectorMetadata()


def test_a_saving_connector_loads_what_the_baseline_computes_and_matches_its_output() -> None:
    workload = make_workload("shared-prefix", 12, seed=3)
    sim = simulate(workload, [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE)
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


def test_degraded_events_are_counted_in_the_result() -> None:
    workload = make_workload("shared-prefix", 2, seed=0)
    setup = ConnectorSetup((MEMORY,), {"fail_hook": "save_kv_layer"})
    run = run_workload(workload, NO_LOCAL_CACHE, setup)
    assert run.stats.degraded_events > 0
    assert run.to_dict()["degraded_events"] == run.stats.degraded_events


def test_a_wrong_load_is_reported_as_a_mismatch() -> None:
    workload = make_workload("shared-prefix", 6, seed=0)
    sim = simulate(workload, [ConnectorSetup((f"{__name__}:LyingConnector",))], NO_LOCAL_CACHE)
    run = sim.runs[0]
    assert run.stats.prompt_tokens_loaded > 0
    assert not sim.verified and run.mismatched
    assert sim.to_dict()["runs"][0]["mismatched_requests"] == run.mismatched


def test_several_connectors_run_together_in_one_host() -> None:
    sim = simulate(make_workload("long-document", 4, seed=0), [ConnectorSetup((MEMORY, "dummy"))], NO_LOCAL_CACHE)
    assert sim.runs[0].label == f"{MEMORY}+dummy"
    assert sim.verified and sim.runs[0].stats.prompt_tokens_loaded > 0


def test_a_turn_is_submitted_only_after_the_previous_one_finished() -> None:
    prompt = list(range(1, 70))
    workload = Workload("two turns", "", 0, [WorkloadRequest(prompt, 4), WorkloadRequest(prompt + [7] * 40, 4, 0, 0)])
    finished_when_submitted: list[int] = []

    def on_progress(label: str, finished: int, total: int) -> None:
        finished_when_submitted.append(finished)

    run = run_workload(workload, NO_LOCAL_CACHE, ConnectorSetup((MEMORY,)), on_progress=on_progress)
    # the second turn found the first turn's whole prompt saved
    assert run.stats.prompt_tokens_loaded == 64
    assert finished_when_submitted[-1] == 2


def test_an_unknown_connector_fails_before_any_run() -> None:
    calls: list[str] = []
    with pytest.raises(ConnectorNotFoundError):
        simulate(
            make_workload("multi-turn", 2), [ConnectorSetup(("no-such",))], on_progress=lambda *a: calls.append(a[0])
        )
    assert calls == []


def test_timed_rounds_follow_one_warm_up_round_and_rotate_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvconn.reference.simulate as sim_module

    order: list[str] = []

    def recording(*args: object, **kwargs: object) -> object:
        result = run_workload(*args, **kwargs)  # type: ignore[arg-type]
        order.append(result.label)
        return result

    monkeypatch.setattr(sim_module, "run_workload", recording)
    sim = simulate(make_workload("shared-prefix", 4, seed=1), [ConnectorSetup((MEMORY,))], NO_LOCAL_CACHE, repeats=3)
    label = "kvconn.testing.memory_connector:MemoryConnector"
    # round 0 is the warm-up; the baseline does not always go first
    assert order == ["no connector", label, label, "no connector", "no connector", label, label, "no connector"]
    for run in (sim.baseline, *sim.runs):
        assert len(run.wall_s_repeats) == 3 and run.wall_s == sorted(run.wall_s_repeats)[1]
        assert run.steps_per_s_min <= run.steps_per_s
    assert sim.verified
