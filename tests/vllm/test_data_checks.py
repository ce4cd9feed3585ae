"""The data checks (KV040-KV049) through vLLM's real scheduler and model-runner code, on a model that reads KV.

vLLM's own recovery runs: invalid blocks under ``kv_load_failure_policy="recompute"``, and
``Scheduler._update_waiting_for_remote_kv`` asking the connector again after an async load
that failed with no valid prefix, which livelocks a connector that claims the block again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconn.reference import EngineShape
from kvconn.testing.conformance import ConfigFactory, DriverSpec, run_conformance

FIXTURES = Path(__file__).parents[2] / "sdk" / "tests" / "conformance" / "fixtures"
LIVELOCK = "kvconn_conformance_fixtures.livelock:"


@pytest.fixture
def fixtures(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(FIXTURES))
    yield


@pytest.mark.usefixtures("runner")
def test_the_data_driver_runs_vllms_scheduler_and_gets_the_reference_engines_tokens() -> None:
    from kvconn.reference import Engine
    from kvconn_vllm.testing.data_driver import VllmDataDriver

    prompt = list(range(10_000, 10_040))
    spec = DriverSpec("offload", None, EngineShape(enable_prefix_caching=False))
    driver = VllmDataDriver(spec, scrub_freed=True)
    for req_id in ("a", "b"):
        driver.add_request(req_id, prompt, 6)
        while driver.has_work():
            driver.step()
    assert type(driver.scheduler).__module__ == "vllm.v1.core.sched.scheduler"
    assert driver.stats.prompt_tokens_loaded == 32  # b loaded a's two full blocks through offload
    with Engine(None, shape=driver.shape) as engine:
        expected = engine.generate([prompt], max_tokens=6)[0]
    assert driver.generated("a") == driver.generated("b") == expected
    assert len(set(expected)) > 1  # the tokens follow the KV, not a constant
    driver.close()


def test_the_preempted_prefill_data_run_preempts_a_prompt_mid_prefill_under_both_runners(runner: str) -> None:
    """KV043's second run through vLLM's scheduler, read from its step records: 'a1' is preempted with its first
    full blocks computed and saved, comes back as the runner expects (V1: in resumed_req_ids with its whole new
    table; V2: a new request), loads them and computes the rest in a chunk ending mid-block; 'b' loads all four of
    its blocks; every token is the connector-less run's."""
    from kvconn.testing.conformance import Session
    from kvconn.testing.conformance.runs import PREEMPTED_PREFILL, data_run, expected_tokens

    session = Session("offload", driver="vllm")
    result = data_run(session, PREEMPTED_PREFILL)
    records, a1 = result.records, result.tag.engine_id("a1")
    at = next(i for i, record in enumerate(records) if a1 in record.preempted)
    computed = sum(record.output.num_scheduled_tokens.get(a1, 0) for record in records[:at])
    assert 16 <= computed < 64  # mid-prefill, a full block of it computed for the connector to save
    resume = next(i for i, record in enumerate(records) if i > at and record.output.num_scheduled_tokens.get(a1))
    assert records[resume].loaded == {a1: 32}  # what it saved before the preemption, into its new table
    scheduled = result.driver.loop.outputs[resume]  # vLLM's own SchedulerOutput of that step
    if runner == "v1":
        assert a1 in scheduled.scheduled_cached_reqs.resumed_req_ids
    else:
        assert [new.req_id for new in scheduled.scheduled_new_reqs] == [a1]
    start = records[resume].output.num_computed_tokens_by_request()[a1]
    assert (start + records[resume].output.num_scheduled_tokens[a1]) % 16  # the resumed chunk ends mid-block
    assert result.loaded("b") == 64
    assert result.tokens == expected_tokens(session, PREEMPTED_PREFILL, result.driver.shape)


@pytest.mark.usefixtures("fixtures")
def test_a_connector_whose_server_outlives_every_run_never_meets_a_request_id_twice_under_vllm() -> None:
    """A server keyed by request id (LMCache's multi-process one), across two validate invocations through vLLM."""
    from kvconn.testing.memory_connector import fresh_namespace

    for _ in range(2):
        report = run_conformance(
            "kvconn_conformance_fixtures.request_server:PerRequestServer",
            driver="vllm",
            config_factory=fresh_namespace,
            select="KV0[14]0",
        )
        assert report.ok and report.passed == 2, [r.message for r in report.results]


@pytest.mark.usefixtures("fixtures")
def test_a_load_into_the_wrong_layer_changes_the_tokens_under_vllm() -> None:
    report = run_conformance("kvconn_conformance_fixtures.broken:WrongLayerLoad", driver="vllm", select="KV040")
    (result,) = report.results
    assert result.status == "failed" and "it ran on wrong KV" in result.message, result


@pytest.mark.usefixtures("fixtures", "runner")
@pytest.mark.parametrize(
    ("connector", "check_id", "observed"),
    [
        # the sum of what a request reads is unchanged: only a model that reads every element in its place sees it
        ("ExchangesKV", "KV040", "it ran on wrong KV"),
        ("ReversesSlots", "KV040", "it ran on wrong KV"),
        # vLLM's own block hasher puts the cache_salt and the LoRA adapter in its hashes; a token-keyed store not
        ("KeysByTokens", "KV047", "request 'b' (cache_salt 'tenant-2') loaded 64 tokens"),
        # its own instance never claims the poisoned block again: a second vLLM scheduler sharing the store does
        ("PoisonsQuietly", "KV041", "'b1' then ran on another engine instance sharing its store), request 'b1' "),
        # two ranks, each a worker-side connector of its own with its tp rank, share one store per run
        ("RankBlindKeys", "KV048", "on tensor-parallel rank 0, block 4 (position 0, layer 'layer.0') holds rank 1's "
         "shard of it: rank 1's value under rank 0's key (the store key misses the rank)"),
        # a count of tokens kept across preemption: a prompt resumed mid-prefill saves blocks it has not recomputed
        ("KeepsCountAcrossPreemption", "KV043", "in the 'preempted-prefill-reuse' data run ('a1' was preempted "
         "mid-prefill with 40 of its 64 prompt tokens computed, then resumed), request 'b' generated"),
        # a worker's per-request "loaded" mark kept past the load: vLLM asks again for a resumed request
        ("LoadsOncePerRequest", "KV049", "was preempted, and resumed with a new table to load again), request "),
    ],
)  # fmt: skip
def test_a_broken_connector_fails_its_check_under_vllm(connector: str, check_id: str, observed: str) -> None:
    report = run_conformance(f"kvconn_conformance_fixtures.broken:{connector}", driver="vllm", select=check_id)
    (result,) = report.results
    assert result.status == "failed" and observed in result.message, result


@pytest.mark.usefixtures("fixtures")
@pytest.mark.parametrize(("connector", "failed"), [("ClaimsFailedBlocks", {"KV046"}), ("RemembersFailedLoads", set())])
def test_the_livelocking_store_fails_under_vllm_and_its_correct_version_passes(
    connector: str, failed: set[str]
) -> None:
    report = run_conformance(LIVELOCK + connector, driver="vllm", select="KV04[0-6]")
    assert report.load_error is None
    assert {r.id for r in report.results if r.status == "failed"} == failed, report.results
    if failed:
        (result,) = (r for r in report.results if r.id == "KV046")
        assert "request 'b' never finishes" in result.message and "answering (272, True)" in result.message
        assert "vLLM 0.33.0 scheduler asks the connector again" in result.message
        assert "fix: stop claiming a block whose load failed" in result.message


@pytest.mark.usefixtures("fixtures", "runner")
def test_vllm_holds_the_blocks_of_a_request_aborted_while_loading_until_the_worker_reports_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.33's ``Scheduler.finish_requests`` keeps a request aborted in ``WAITING_FOR_REMOTE_KVS`` (and its
    blocks) until ``finished_recving`` reports its load: a worker that drops that report leaks them for ever, and
    the diagnosis says so as on the reference engine. Its correct version passes."""
    from kvconn.testing.conformance.waits import WAIT_ENV

    monkeypatch.setenv(WAIT_ENV, "1")
    config = {"load_delay_s": 0.3}
    report = run_conformance(LIVELOCK + "ForgetsAbortedLoads", driver="vllm", config=config, select="KV03[01]")
    assert [(r.id, r.status) for r in report.results] == [("KV030", "failed"), ("KV031", "passed")]
    message = report.result("KV030").message
    assert "in scenario 'abort-while-loading'" in message and (
        "request 'r1' waits for finished_recving since step 6, when its async load was in flight (it waited in "
        "WAITING_FOR_REMOTE_KVS): then it was aborted, and its blocks stay held until finished_recving reports the "
        "load" in message
    ), message
    correct = run_conformance(LIVELOCK + "SlowLoads", driver="vllm", config=config, select="KV03[01]")
    assert [r.status for r in correct.results] == ["passed", "passed"], correct.results


@pytest.mark.usefixtures("fixtures")
def test_a_connector_blocking_every_vllm_step_on_a_slow_save_is_told_the_hook_budget() -> None:
    """The adapter's host stops calling a ``wait_for_save`` that takes 1.1 s three steps in a row, as the reference
    engine's does: the check names the hook and the budget, and the fix for that, not its own."""
    from kvconn.testing.conformance.diagnose import HOOK_BUDGET_FIX

    (result,) = run_conformance(LIVELOCK + "SlowSaves", driver="vllm", select="KV040").results
    assert result.status == "failed"
    assert "3 calls of wait_for_save in a row took longer than its hook budget of 1 s" in result.message
    assert result.message.endswith(f"; fix: {HOOK_BUDGET_FIX.format(hook='wait_for_save')}")


@pytest.mark.usefixtures("fixtures")
@pytest.mark.parametrize(("connector", "failed"), [("ClaimsFailedBlocks", {"KV046"}), ("RemembersFailedLoads", set())])
def test_a_sync_store_claiming_a_failed_block_livelocks_vllm_with_two_groups_and_its_correct_version_passes(
    connector: str, failed: set[str]
) -> None:
    """With several KV-cache groups vLLM re-asks after a failed sync load too (the adapter shows it every load as
    async to report the failure per request): KV046's two-group run catches a sync store that claims it again."""
    report = run_conformance(LIVELOCK + connector, config={"load_async": False}, driver="vllm", select="KV04[06]")
    assert {r.id for r in report.results if r.status == "failed"} == failed, report.results
    if failed:
        (result,) = (r for r in report.results if r.id == "KV046")
        assert "'persistent-failure-two-groups', request 'b' never finishes" in result.message, result.message
        assert "answering (272, False)" in result.message


def _embedded_store(run: str) -> dict[str, str]:
    """Mooncake's embedded store lives as long as the process: a fresh one per run (KV041 then loses blocks too)."""
    return {"embedded_store": f"{run}-{uuid.uuid4().hex}"}


def _embedded_store_async(run: str) -> dict[str, Any]:
    """As :func:`_embedded_store`, loading asynchronously: each value read into vLLM's blocks, verified there."""
    return {**_embedded_store(run), "load_async": True}


def _offload_loads_async(run: str) -> dict[str, Any]:
    """Offload's async loads (its default on an accelerator; on these host KV caches it loads in the step)."""
    return {"load_async": True}


def _embedded_store_saves_sync(run: str) -> dict[str, Any]:
    """As :func:`_embedded_store`, each step's put in ``wait_for_save`` (Mooncake's default puts on a store thread)."""
    return {**_embedded_store(run), "save_async": False}


@pytest.mark.usefixtures("runner")
@pytest.mark.parametrize(
    ("connector", "factory"),
    [
        ("offload", None),
        ("offload", _offload_loads_async),
        ("mooncake", _embedded_store),
        ("mooncake", _embedded_store_async),
        ("mooncake", _embedded_store_saves_sync),
    ],
    ids=["offload", "offload-async-loads", "mooncake", "mooncake-async-in-place", "mooncake-saves-sync"],
)
def test_shipped_connectors_pass_the_data_checks_under_vllm(connector: str, factory: ConfigFactory | None) -> None:
    report = run_conformance(connector, driver="vllm", select="KV04*", config_factory=factory)
    assert report.load_error is None
    assert report.failed == 0 and report.passed == 10 and report.skipped == 0, report.results  # KV048: two ranks


@pytest.mark.usefixtures("runner")
def test_the_redis_connector_passes_every_check_under_vllm_against_a_real_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shipped store connector over a real redis-server (the plugin's own test helper starts it)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "plugins" / "redis" / "tests"))
    from redis_server import RedisServer, require_redis_server

    from kvconn_redis import fresh_namespace

    require_redis_server()
    server = RedisServer().start()
    try:
        report = run_conformance(
            "redis", driver="vllm", config_factory=lambda run: {**fresh_namespace(run), "url": server.url}
        )
    finally:
        server.stop()
    assert report.load_error is None
    assert report.failed == 0 and report.skipped == 0 and report.passed == 29, report.results  # KV048 too


def test_kvconn_validate_engine_vllm_fails_the_livelocking_store() -> None:
    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM venv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURES), os.environ.get("PYTHONPATH", "")])}
    name = LIVELOCK + "ClaimsFailedBlocks"
    result = subprocess.run(
        [kvconn, "validate", name, "--engine", "vllm", "--check", "KV04[06]", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    failed = {r["id"]: r["message"] for r in report["checks"] if r["status"] == "failed"}
    assert set(failed) == {"KV046"} and "never finishes" in failed["KV046"]
