"""A load that fails every time: the reference engine re-asks the connector as vLLM 0.33 does, and the suite
stops a connector that claims the failed block again (the livelock it causes in vLLM), naming what to fix."""

from __future__ import annotations

import pytest

from kvconn.reference import EngineShape
from kvconn.testing.conformance import DriverSpec, ReferenceDriver, run_conformance
from kvconn.testing.conformance.catalog import get_check
from kvconn.testing.conformance.convergence import LIVELOCK_FIX, LOAD_FIX, LOAD_STEPS, REPEATS, NotConverging
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


def test_a_load_never_reported_finished_stops_the_run_within_a_bound() -> None:
    report = run_conformance(LIVELOCK + "NeverFinishesLoads", select="KV040")
    (result,) = report.results
    assert result.status == "failed"
    assert (
        f"request 'b' never finishes: its async load of 4 block(s) has not been reported in finished_recving "
        f"for {LOAD_STEPS} steps" in result.message
    )
    assert result.message.endswith(f"; fix: {LOAD_FIX}")
