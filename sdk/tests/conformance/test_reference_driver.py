"""The reference driver records what the checks rely on, and injects a real failed load."""

from __future__ import annotations

import pytest

from kvconn.reference import EngineShape
from kvconn.testing.conformance import DriverSpec, ReferenceDriver
from kvconn.testing.conformance.waits import WAIT_ENV

STORE = "kvconn.testing.memory_connector:MemoryConnector"
SLOW_FREES = "kvconn_conformance_fixtures.livelock:SlowFrees"


def test_step_record_offers_every_scheduled_request_and_counts_resolves() -> None:
    driver = ReferenceDriver(DriverSpec("dummy"))
    driver.add_request("a", list(range(10_000, 10_020)), 4)
    driver.add_request("b", list(range(20_000, 20_017)), 4)
    first = driver.step(withhold={"b"})
    assert set(first.output.num_scheduled_tokens) == {"a", "b"}
    assert first.offered == {"a"} and first.resolved == ["a"]  # both fill block 0; b is not offered
    assert first.tables == {"a": ([1, 2],), "b": ([3, 4],)}
    assert first.metadata == first.decoded and first.encoded
    assert first.connector_output is not None
    second = driver.step()
    assert second.offered == {"a", "b"} and second.resolved == ["b"]  # only b has a block to ship
    driver.close()


def test_first_load_fails_and_the_engine_recomputes_it() -> None:
    driver = ReferenceDriver(
        DriverSpec(STORE, {"store": "driver-test"}, EngineShape(enable_prefix_caching=False)), fail_loads="first"
    )
    prompt = list(range(10_000, 10_040))
    driver.add_request("a", prompt, 2)
    while driver.has_work():
        driver.step()
    driver.add_request("b", prompt, 2)
    while driver.has_work():
        driver.step()
    assert driver.injected_failure
    assert driver.stats.failed_load_blocks == 1
    assert driver.generated("a") == driver.generated("b")
    driver.close()


def test_fail_first_load_is_still_the_first_mode() -> None:
    spec = DriverSpec(STORE, {"store": "driver-test-old"}, EngineShape(enable_prefix_caching=False))
    driver = ReferenceDriver(spec, fail_first_load=True)
    assert driver.failures is not None and driver.failures.mode == "first"
    driver.close()


def test_the_preempted_prefill_scenario_preempts_a_prompt_mid_prefill_and_it_finishes_after_its_resume() -> None:
    """What the liveness scenario claims to play, on the reference engine: r1 is preempted with part of its prompt
    computed, resumed, and finishes, the connector (offload) in place."""
    from kvconn.testing.conformance.scenarios import STANDARD, run_scenario

    scenario = next(s for s in STANDARD if s.name == "preempted-prefill")
    trace = run_scenario(ReferenceDriver, scenario, "offload", None)
    assert trace.error is None and not trace.stuck, trace.error
    r1 = trace.tag.engine_id("r1")  # the engine's id of r1 (see kvconn.testing.conformance.request_ids)
    computed = 0
    for record in trace.records:
        if r1 in record.preempted:
            break
        computed += record.output.num_scheduled_tokens.get(r1, 0)
    else:
        raise AssertionError("r1 was never preempted")
    assert 0 < computed < 64  # mid-prefill: part of its 64-token prompt computed
    resumed = trace.records.index(record) + 1
    assert any(r.output.num_scheduled_tokens.get(r1) for r in trace.records[resumed:])
    assert trace.finished_calls.get(r1) == 1  # it finished (request_finished ran once)


def test_the_preempted_prefill_data_run_preempts_a_prompt_mid_prefill_and_its_prefix_loads_exact() -> None:
    """What KV043's second run claims to play, on the reference engine, read from its step records: 'a1' is
    preempted with its first full blocks computed (and saved), resumes, loads them back and computes the rest in a
    chunk ending mid-block; 'b' loads all four of its blocks; every token is the connector-less run's."""
    from kvconn.testing.conformance import Session
    from kvconn.testing.conformance.runs import PREEMPTED_PREFILL, data_run, expected_tokens
    from kvconn.testing.memory_connector import fresh_namespace

    session = Session(STORE, config_factory=fresh_namespace)
    result = data_run(session, PREEMPTED_PREFILL)
    records, a1 = result.records, result.tag.engine_id("a1")
    at = next(i for i, record in enumerate(records) if a1 in record.preempted)
    computed = sum(record.output.num_scheduled_tokens.get(a1, 0) for record in records[:at])
    assert 16 <= computed < 64  # mid-prefill, a full block of it computed for the connector to save
    resume = next(record for record in records[at:] if record.output.num_scheduled_tokens.get(a1))
    assert resume.loaded == {a1: 32}  # what it saved before the preemption, loaded into its new table
    start = resume.output.num_computed_tokens_by_request()[a1]
    assert (start + resume.output.num_scheduled_tokens[a1]) % 16  # the resumed chunk ends mid-block
    assert result.loaded("b") == 64
    assert result.tokens == expected_tokens(session, PREEMPTED_PREFILL, result.driver.shape)


def test_a_free_reported_late_is_waited_for_by_the_suites_wall_bound_not_its_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """'a' ends at once; its free is reported 1 s later, while 'b' keeps the engine stepping (hundreds of steps).

    A host bounding stalls by steps alone (128) failed this correct connector, whatever ``--wait-s`` said.
    """
    monkeypatch.setenv(WAIT_ENV, "5")
    driver = ReferenceDriver(DriverSpec(SLOW_FREES, {"free_delay_s": 1.0}, EngineShape(num_blocks=128)))
    driver.add_request("a", list(range(10_000, 10_020)), 1)
    driver.add_request("b", list(range(20_000, 20_020)), 1_000)
    scheduler, steps = driver.engine.scheduler, 0
    while "a" in scheduler.requests or "a" in scheduler.held_requests:  # raises, under a bound in steps alone
        driver.step()
        steps += 1
    assert steps > 128
    driver.close()


def test_the_worker_hears_of_a_request_aborted_before_it_was_scheduled(monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM's ``Scheduler._free_request``: every finished request goes to the workers' ``finished_req_ids``, so
    a connector that delays the free of a request aborted while waiting can report it when the worker hears."""
    driver = ReferenceDriver(DriverSpec(SLOW_FREES, {"free_delay_s": 0.0}))
    driver.add_request("a", list(range(10_000, 10_020)), 4)
    driver.abort("a")
    assert driver.engine.scheduler.held_requests == {"a"}  # request_finished delayed its free
    record = driver.step()
    assert "a" in record.output.finished_req_ids
    driver.step()
    assert not driver.engine.scheduler.held_requests and not driver.has_work()
    driver.close()
