"""A load that fails every time: the reference engine re-asks the connector as vLLM 0.33 does, and the suite
stops a connector that claims the failed block again (the livelock it causes in vLLM), naming what to fix."""

from __future__ import annotations

import pytest

from kvconn.reference import EngineShape
from kvconn.testing.conformance import DriverSpec, ReferenceDriver, run_conformance
from kvconn.testing.conformance.catalog import get_check
from kvconn.testing.conformance.convergence import LIVELOCK_FIX, LOAD_FIX, LOAD_STEPS, REPEATS, NotConverging
from kvconn.testing.conformance.diagnose import HOOK_BUDGET_FIX
from kvconn.testing.conformance.waits import DEFAULT_WAIT_S, WAIT_ENV, wait_seconds
from kvconn.testing.memory_connector import fresh_namespace

LIVELOCK = "kvconn_conformance_fixtures.livelock:"
PROMPT = list(range(10_000, 10_040))  # two full blocks, then 8 tokens


def _drive(connector: str, config: dict[str, str], asked: list[str] | None = None) -> ReferenceDriver:
    """``a`` saves; ``b`` (the same prompt) loads, and every load of block 0's content fails.

    ``asked`` collects the request of each ``get_num_new_matched_tokens`` call.
    """
    spec = DriverSpec(connector, config, EngineShape(enable_prefix_caching=False))
    driver = ReferenceDriver(spec, fail_loads="persistent", scrub_freed=True)
    host = driver.engine.scheduler_host
    if asked is not None and host is not None:
        host.add_monitor(lambda call, args: asked.append(args[0].request_id), calls="get_num_new_matched_tokens")
    for req_id in ("a", "b"):
        driver.add_request(req_id, PROMPT, 2)
        for _ in range(200):
            if not driver.has_work():
                break
            driver.step()
    return driver


def test_after_a_failed_async_load_with_no_valid_prefix_the_engine_asks_the_connector_again() -> None:
    asked: list[str] = []
    driver = _drive(LIVELOCK + "RemembersFailedLoads", fresh_namespace("asked"), asked)
    assert driver.injected_failure and driver.stats.failed_load_blocks == 1
    # b: asked, loaded, its block 0 failed, the blocks were freed and b asked again (it claims nothing now)
    assert asked.count("b") == 2
    assert driver.generated("b") == driver.generated("a")
    assert driver.stats.prompt_tokens_computed == 2 * len(PROMPT)  # b recomputed its whole prompt
    driver.close()


def test_a_connector_claiming_the_failed_block_again_is_stopped_with_the_request_the_hook_and_the_fix() -> None:
    with pytest.raises(NotConverging) as caught:
        _drive(LIVELOCK + "ClaimsFailedBlocks", fresh_namespace("livelock"))
    message = str(caught.value)
    assert "request 'b' never finishes" in message
    assert f"get_num_new_matched_tokens claimed that block again, answering (32, True) each time, {REPEATS}" in message
    assert caught.value.fix == LIVELOCK_FIX


@pytest.mark.parametrize(
    ("connector", "failed"),
    [("ClaimsFailedBlocks", {"KV046"}), ("RemembersFailedLoads", set())],
)
def test_validate_fails_the_livelocking_connector_and_passes_its_correct_version(
    connector: str, failed: set[str]
) -> None:
    report = run_conformance(LIVELOCK + connector, select="KV04[06]")
    assert report.load_error is None
    assert {r.id for r in report.results if r.status == "failed"} == failed, report.results
    if failed:
        (result,) = (r for r in report.results if r.id == "KV046")
        assert "in data run 'persistent-failure', request 'b' never finishes" in result.message
        assert result.message.endswith(f"; fix: {get_check('KV046').fix}")


def test_a_load_never_reported_finished_stops_the_run_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WAIT_ENV, "0.5")
    report = run_conformance(LIVELOCK + "NeverFinishesLoads", select="KV040")
    (result,) = report.results
    assert result.status == "failed"
    steps = int(result.message.split("reported in finished_recving for ")[1].split(" steps")[0])
    assert steps > LOAD_STEPS
    assert "request 'b' never finishes: its async load of 4 block(s) has not been reported" in result.message
    assert "the wait bound is 0.5 s: for a store that is merely slow, raise it with --wait-s" in result.message
    assert result.message.endswith(f"; fix: {LOAD_FIX}")


def test_a_load_slower_than_the_old_step_bounds_passes_within_the_wall_clock_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each load takes 2.5 s: over 64 idle steps (and the 2 s kvconn allowed before), within the 10 s default."""
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert wait_seconds() == DEFAULT_WAIT_S == 10
    report = run_conformance(LIVELOCK + "SlowLoads", select="KV040")
    assert [r.status for r in report.results] == ["passed"], report.results


def test_a_load_slower_than_the_wall_clock_bound_fails_naming_the_bound_and_how_to_raise_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(WAIT_ENV, "1")
    report = run_conformance(LIVELOCK + "SlowLoads", config={"load_delay_s": 3.0}, select="KV040")
    (result,) = report.results
    assert result.status == "failed"
    assert "request 'b' never finishes: its async load of 4 block(s)" in result.message
    assert "the wait bound is 1 s: for a store that is merely slow, raise it with --wait-s" in result.message


def test_a_connector_blocking_every_step_on_a_slow_save_is_told_the_hook_budget_not_the_checks_fix() -> None:
    """The host stops calling a connector whose ``wait_for_save`` takes 1.1 s three steps in a row; the check says
    so, and how to fix it, instead of blaming the mechanism it was about to judge (here KV040's)."""
    report = run_conformance(LIVELOCK + "SlowSaves", select="KV040")
    (result,) = report.results
    assert result.status == "failed"
    assert result.message.startswith("observed the host stopped calling the connector in data run ")
    assert "3 calls of wait_for_save in a row took longer than its hook budget of 1 s (the last 1.1" in result.message
    assert result.message.endswith(f"; fix: {HOOK_BUDGET_FIX.format(hook='wait_for_save')}")
    assert get_check("KV040").fix not in result.message


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan", "inf"])
def test_a_wait_bound_that_is_not_a_positive_number_of_seconds_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(WAIT_ENV, value)
    with pytest.raises(ValueError, match=f"{WAIT_ENV}={value!r} is not a positive number of seconds"):
        wait_seconds()


def test_a_worker_dropping_the_load_of_a_request_aborted_meanwhile_fails_request_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine holds the blocks of a request aborted while its async load is in flight until the load is
    reported (vLLM's ``Scheduler.finish_requests``): a worker that drops that report because the request ended
    holds them for ever (vllm-ascend issue 16662). Its correct version passes."""
    monkeypatch.setenv(WAIT_ENV, "1")
    config = {"load_delay_s": 0.3}  # in flight when the scenario aborts it, a step later
    report = run_conformance(LIVELOCK + "ForgetsAbortedLoads", config=config, select="KV03*")
    assert [(r.id, r.status) for r in report.results] == [
        ("KV030", "failed"),
        ("KV031", "passed"),
        ("KV032", "skipped"),
    ]
    assert report.result("KV032").message.startswith("not run: KV030 request-finished failed first")  # one cause
    message = report.result("KV030").message
    assert (
        "in scenario 'abort-while-loading': after every request ended, for " in message
        and "request 'r1' waits for finished_recving since step 5, when get_num_new_matched_tokens returned (64, True) "
        "for it (an async load): then it was aborted, and its blocks stay held until finished_recving reports the "
        "load (the worker may still be writing into them), and get_finished never reported it; fix: report 'r1' in "
        "get_finished's finished_recving (once) when the async load started for it"
        in message
    ), message
    assert "also when the request ended meanwhile (finished_req_ids)" in message
    correct = run_conformance(LIVELOCK + "SlowLoads", config=config, select="KV03*")
    assert [r.status for r in correct.results] == ["passed", "passed", "passed"], correct.results
