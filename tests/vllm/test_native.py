"""``kvconn validate --engine vllm --vllm-connector``: vLLM's own connectors judged through vLLM's scheduler.

vLLM 0.33 here (``.venv-vllm``); vLLM 0.29's ``MooncakeStoreConnector`` is in ``tests/vllm_029``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvconn.testing.conformance.scenarios import STANDARD
from kvconn_vllm.testing.native import run_native_conformance
from kvconn_vllm.testing.native_session import NOT_APPLICABLE, NativeSession
from kvconn_vllm.testing.native_target import native_target

HERE = Path(__file__).parent
FIXTURES = "native_connectors"


@pytest.fixture
def fixtures(monkeypatch: pytest.MonkeyPatch) -> str:
    """Make ``native_connectors`` importable (here and in subprocesses); its module name."""
    monkeypatch.syspath_prepend(str(HERE))
    return FIXTURES


def _failed(report: object) -> dict[str, str]:
    return {r.id: r.message for r in report.results if r.status == "failed"}  # type: ignore[attr-defined]


def test_example_connector_fails_on_a_prompt_repeated_after_chunked_prefill(tmp_path: Path) -> None:
    """vLLM issue 16928 (fix PR 53314, open): under chunked prefill ExampleConnector saves only the first chunk
    and claims the whole prompt; the repeated prompt's load crashes the worker. Run through the real CLI."""
    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM venv"
    config = json.dumps({"shared_storage_path": str(tmp_path)})
    result = subprocess.run(
        [kvconn, "validate", "--engine", "vllm", "--vllm-connector", "ExampleConnector", "--config", config,
         "--check", "KV0[01]*", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["KV010"]["status"] == "failed"
    message = checks["KV010"]["message"]
    assert "repeat-after-chunks" in message and "shape mismatch" in message, message
    assert checks["KV001"]["status"] == "skipped"
    assert "does not apply to a vLLM connector" in checks["KV001"]["message"]
    assert "vLLM offers every scheduled request" in checks["KV013"]["message"]


#: vLLM's ExampleConnector names a prompt's folder by a hash of its token ids alone (``_generate_foldername_debug``):
#: a request under another cache_salt, or LoRA adapter, loads the first one's KV.
EXAMPLE_CONNECTOR_ISOLATION = "request 'b' (cache_salt 'tenant-2') loaded 64 tokens of the prefix 'a' computed"


def test_example_connector_with_the_fix_passes_every_check_that_applies_but_isolation(
    tmp_path: Path, fixtures: str
) -> None:
    name = f"{fixtures}:ChunkedPrefillExampleConnector"
    report = run_native_conformance(name, config={"shared_storage_path": str(tmp_path)})
    assert report.load_error is None and set(_failed(report)) == {"KV047"}, _failed(report)
    assert EXAMPLE_CONNECTOR_ISOLATION in _failed(report)["KV047"]
    statuses = {r.id: r.status for r in report.results}
    assert all(statuses[c] == "passed" for c in ("KV010", "KV011", "KV012", "KV015", "KV021", "KV030", "KV031"))
    assert all(statuses[c] == "skipped" for c in NOT_APPLICABLE)
    # the fix is what ran: the repeated prompt loaded its 64 full-block tokens from the connector
    session = NativeSession(native_target(name), {"shared_storage_path": str(tmp_path / "again")})
    trace = session.trace(next(s for s in STANDARD if s.name == "repeat-after-chunks"))
    assert trace.error is None
    r1 = trace.tag.engine_id("r1")  # what vLLM calls r1 (kvconn.testing.conformance.request_ids)
    first = [new for rec in trace.records for new in rec.output.scheduled_new_reqs if new.req_id == r1]
    assert first and first[0].num_computed_tokens == 64


def test_example_connector_with_the_fix_passes_the_data_checks_loading_through_its_own_worker(
    tmp_path: Path, fixtures: str
) -> None:
    """The data checks run the connector's own worker on the KV the model reads: its loads decide the tokens."""
    from kvconn.testing.conformance.runs import data_runs

    name = f"{fixtures}:ChunkedPrefillExampleConnector"
    report = run_native_conformance(name, config={"shared_storage_path": str(tmp_path)}, select="KV04*")
    statuses = {r.id: r.status for r in report.results}
    assert statuses == {
        **{f"KV04{i}": "passed" for i in range(7)},
        "KV047": "failed",
        "KV048": "passed",
        "KV049": "passed",
    }
    runs = {case.name: result for case, result in data_runs(NativeSession(native_target(name), {
        "shared_storage_path": str(tmp_path / "again")
    }))}  # fmt: skip
    assert runs["failed-load"].driver.injected_failure and runs["persistent-failure"].driver.injected_failure
    # it reuses whole prompts only (up to their last full block): the runs sharing a part of one load nothing
    loaded = {case: result.driver.stats.prompt_tokens_loaded for case, result in runs.items()}
    assert loaded["chunked-reuse"] == 0 and loaded["large-blocks-reuse"] == 256 and loaded["mid-block-chunks"] > 0
    assert "two-groups-reuse" not in runs  # not SupportsHMA: vLLM runs it with one KV-cache group only


def test_a_vllm_connector_loading_into_the_wrong_blocks_fails_the_round_trip_through_the_cli(
    tmp_path: Path, fixtures: str
) -> None:
    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM venv"
    config = json.dumps({"shared_storage_path": str(tmp_path)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [kvconn, "validate", "--engine", "vllm", "--vllm-connector", f"{fixtures}:OffByOneBlockLoadsConnector",
         "--config", config, "--check", "KV04*", "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["KV040"]["status"] == "failed", checks["KV040"]
    assert "large-blocks-reuse" in checks["KV040"]["message"] and "it ran on wrong KV" in checks["KV040"]["message"]


def test_a_vllm_connector_whose_worker_skips_its_loads_passes_the_scenarios_and_fails_the_round_trip(
    tmp_path: Path, fixtures: str
) -> None:
    report = run_native_conformance(
        f"{fixtures}:SkipsLoadsConnector", config={"shared_storage_path": str(tmp_path)}, select="KV0[14]*"
    )
    statuses = {r.id: r.status for r in report.results}
    assert statuses["KV010"] == statuses["KV011"] == "passed"  # only the KV the model reads shows it
    assert statuses["KV040"] == "failed" and "it ran on wrong KV" in _failed(report)["KV040"]
    assert "request 'b' generated " in _failed(report)["KV040"]  # named as the data run names it, not as vLLM saw it


def test_metadata_holding_vllms_block_state_fails_kv021(tmp_path: Path, fixtures: str) -> None:
    report = run_native_conformance(
        f"{fixtures}:BlockStateInMetadataConnector", config={"shared_storage_path": str(tmp_path)}, select="KV021"
    )
    (result,) = report.results
    assert result.status == "failed" and "KVConnectorBlockState" in result.message, result.message


def test_mooncake_store_connector_033_passes_block_fill_with_a_stand_in_worker() -> None:
    report = run_native_conformance("MooncakeStoreConnector", select="KV011")
    assert report.load_error is None
    (result,) = report.results
    assert result.status == "passed", result.message
    assert any("stand-in (MooncakeStoreStandInWorker)" in n and "torch.cuda.Event" in n for n in report.notes)


def test_an_unknown_vllm_connector_is_a_load_error_naming_the_known_ones() -> None:
    report = run_native_conformance("NoSuchConnector")
    assert report.results == [] and report.load_error is not None
    assert "ExampleConnector" in report.load_error and "pkg.mod" not in report.load_error
    not_one = run_native_conformance("kvconn.errors:KVConnError")
    assert not_one.load_error is not None and "not a KVConnectorBase_V1 subclass" in not_one.load_error


def test_offloading_connector_runs_on_the_stand_in_spec_and_fails_only_the_persistent_load_failure() -> None:
    """vLLM's own OffloadingConnector (scheduler, manager, worker half) on the stand-in spec, every check.

    Its one failure is real: it has no failed-load path (vLLM issue 39732), so it claims a failed block again.
    """
    report = run_native_conformance("OffloadingConnector")
    assert report.load_error is None
    assert set(_failed(report)) == {"KV046"}, _failed(report)
    assert "claimed that block again" in _failed(report)["KV046"]
    statuses = {r.id: r.status for r in report.results}
    assert all(statuses[f"KV0{i}"] == "passed" for i in (10, 11, 12, 14, 15, 21, 22, 30, 31, 40, 41, 42, 43, 44, 45))
    assert any("CPUStandInOffloadingSpec" in n and "needs CUDA or XPU" in n for n in report.notes), report.notes


def test_offloading_connector_with_a_failed_load_path_passes_every_check_loading_through_the_stand_in(
    fixtures: str,
) -> None:
    """The data checks ran real copies: the round trips loaded from the stand-in's CPU chunks, two groups too."""
    from kvconn.testing.conformance.runs import PERSISTENT_FAILURE_TWO_GROUPS, data_run, data_runs

    name = f"{fixtures}:FailedLoadAwareOffloadingConnector"
    report = run_native_conformance(name)
    assert report.load_error is None and report.ok, _failed(report)
    assert {r.id for r in report.results if r.status == "passed"} >= {f"KV04{i}" for i in range(7)}
    session = NativeSession(native_target(name))
    runs = {case.name: result for case, result in data_runs(session)}
    assert runs["two-groups-reuse"].driver.stats.prompt_tokens_loaded > 0  # SupportsHMA: its two-group run too
    # with two groups the injected failure reaches vLLM per request (failed_recving), and vLLM recovers
    two_groups = data_run(session, PERSISTENT_FAILURE_TWO_GROUPS, fail_loads="persistent")
    assert two_groups.driver.injected_failure and two_groups.driver.stats.failed_load_blocks > 0
    # failed-load-elsewhere's last request runs on a second instance: an instance's CPU chunks are its own
    loaded = {case: result.driver.stats.prompt_tokens_loaded for case, result in runs.items()}
    assert loaded.pop("failed-load-elsewhere") == 0 and all(loaded.values()), loaded


def test_an_offloading_connector_loading_into_rotated_blocks_fails_the_round_trip(fixtures: str) -> None:
    report = run_native_conformance(f"{fixtures}:RotatedLoadsOffloadingConnector", select="KV0[14]*")
    statuses = {r.id: r.status for r in report.results}
    assert statuses["KV010"] == statuses["KV012"] == "passed"  # the right blocks: only the KV the model reads shows it
    assert statuses["KV040"] == "failed" and "it ran on wrong KV" in _failed(report)["KV040"]


def test_a_users_own_offloading_spec_replaces_the_stand_in() -> None:
    """With spec_name in --config the user's spec runs (here vLLM's CPUOffloadingSpec, which needs a GPU)."""
    report = run_native_conformance(
        "OffloadingConnector", config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 24}, select="KV010"
    )
    (result,) = report.results
    assert result.status == "failed" and "only supported on CUDA-alike and XPU GPUs" in result.message
    assert not report.notes


def test_a_correct_vllm_connector_whose_metadata_names_no_request_passes_every_check_that_applies(
    fixtures: str,
) -> None:
    """(block hash, block id) pairs and nothing else: the verdicts come from what lands and when tables are read."""
    report = run_native_conformance(f"{fixtures}:HashedBlocksConnector", config={"store": uuid.uuid4().hex})
    assert report.load_error is None and report.failed == 0, _failed(report)
    statuses = {r.id: r.status for r in report.results}
    passing = ("KV011", "KV012", "KV014", "KV040", "KV041", "KV046", "KV047", "KV048", "KV049")
    assert all(statuses[c] == "passed" for c in passing), statuses


def test_a_vllm_connector_whose_keys_leave_out_the_tensor_parallel_rank_fails_kv048(fixtures: str) -> None:
    """Two ranks, each the connector's own worker built with its rank (parallel_config.rank), share its store."""
    report = run_native_conformance(
        f"{fixtures}:RankBlindHashedConnector", config={"store": uuid.uuid4().hex}, select="KV04[08]"
    )
    assert report.result("KV040").status == "passed"  # right with one rank
    result = report.result("KV048")
    assert result.status == "failed" and "holds rank 0's shard of it: rank 0's value under rank 1's key" in (
        result.message
    ), result.message


def test_the_seeds_bug_in_a_vllm_connector_whose_metadata_names_no_request_fails_block_fill(fixtures: str) -> None:
    """It saves only for requests that got new blocks: the block filled by a prefill chunk that allocated none is
    never saved, and a request sharing it loads one block short."""
    report = run_native_conformance(f"{fixtures}:NewBlocksOnlyHashedConnector", config={"store": uuid.uuid4().hex})
    first = next(r for r in report.results if r.status == "failed")
    assert first.id == "KV011", first
    assert "in the 'block-fill-reuse' data run" in first.message
    assert "'b', sharing all three, loaded 32 tokens of them, where it loads 48 when 'a''s prompt" in first.message
    assert "the block filled on the step that allocated none was never saved" in first.message


def test_a_vllm_connector_claiming_a_whole_block_aligned_prompt_fails_with_the_engines_exception(
    fixtures: str,
) -> None:
    """vLLM's scheduler asserts that a request has a token to compute: the engine core dies there. The verdict
    quotes vLLM's own assertion where it was raised, and the cause in the connector's terms."""
    report = run_native_conformance(
        f"{fixtures}:ClaimsWholePromptConnector", config={"store": uuid.uuid4().hex}, select="KV010"
    )
    (result,) = report.results
    observed, fix = result.message.split("; fix: ")
    assert result.status == "failed" and "the engine raised in scenario 'aligned-repeat'" in observed, observed
    assert "vllm/v1/core/sched/scheduler.py" in observed and "assert num_new_tokens > 0" in observed
    assert "get_num_new_matched_tokens claimed every token of a prompt" in observed
    assert fix.startswith("leave at least one prompt token to compute")


@pytest.mark.usefixtures("runner")
def test_a_vllm_connector_claiming_a_resumed_prompt_it_never_saved_kills_the_engine_after_a_mid_prefill_preemption(
    fixtures: str,
) -> None:
    """Preempted with 45 of its 64 prompt tokens computed, r1 comes back (V1: resumed_req_ids; V2: a new request)
    and the connector claims its whole prompt: vLLM's scheduler asserts, under both runners. The same connector
    is right about a request preempted while decoding (the 'preemption' scenario): only mid-prefill shows it."""
    from kvconn.testing.conformance.scenarios import STANDARD

    name = f"{fixtures}:ClaimsPromptOnResumeConnector"
    session = NativeSession(native_target(name), {"store": uuid.uuid4().hex})
    traces = {s.name: session.trace(s) for s in STANDARD if s.name in ("preemption", "preempted-prefill")}
    assert traces["preemption"].error is None, traces["preemption"].error
    error = traces["preempted-prefill"].error
    assert error is not None and error.startswith("the engine raised in scenario 'preempted-prefill', step "), error
    assert "vllm/v1/core/sched/scheduler.py" in error and "assert num_new_tokens > 0" in error
    assert "get_num_new_matched_tokens claimed every token of a prompt" in error
    assert traces["preempted-prefill"].fix.startswith("leave at least one prompt token to compute")


@pytest.mark.usefixtures("runner")
def test_a_vllm_connector_appending_a_resumed_requests_table_fails_preempted_saves(fixtures: str) -> None:
    """LMCache's request-tracker pattern: a table kept across preemption, the resumed request's blocks appended
    (V1: resumed_req_ids with the whole new table; V2: the request comes back as new). Its metadata names no
    request, so the bytes decide: a later request loads what it saved from other requests' blocks."""
    report = run_native_conformance(
        f"{fixtures}:AppendsAfterPreemptionConnector", config={"store": uuid.uuid4().hex}, select="KV04[0-3]"
    )
    failed = _failed(report)
    assert set(failed) == {"KV043"}, failed
    assert "in the 'preempted-saves' data run, request 'b" in failed["KV043"] and "ran on wrong KV" in failed["KV043"]


@pytest.mark.parametrize("connector", ["HashedBlocksConnector", "AppendsAfterPreemptionConnector"])
def test_a_prompt_preempted_mid_prefill_catches_the_appended_table_under_both_runners(
    fixtures: str, runner: str, connector: str
) -> None:
    """KV043's mid-prefill run on its own: 'a1' is preempted with part of its prompt computed (read from the run's
    steps) and comes back (V1: resumed_req_ids; V2: a new request); the request-tracker pattern then saves other
    blocks' bytes under its hashes, and 'b' runs on them. The same connector reading vLLM's live table passes."""
    from kvconn.testing.conformance.checks.data import RESUMED_PREFILL_FIX, preempted_mid_prefill
    from kvconn.testing.conformance.results import ConformanceFailure
    from kvconn.testing.conformance.runs import PREEMPTED_PREFILL, data_run

    session = NativeSession(native_target(f"{fixtures}:{connector}"), {"store": uuid.uuid4().hex})
    result = data_run(session, PREEMPTED_PREFILL)
    records, a1 = result.records, result.tag.engine_id("a1")
    at = next(i for i, record in enumerate(records) if a1 in record.preempted)
    assert 16 <= sum(record.output.num_scheduled_tokens.get(a1, 0) for record in records[:at]) < 64
    if connector == "HashedBlocksConnector":
        preempted_mid_prefill(session)
        return
    with pytest.raises(ConformanceFailure) as failure:
        preempted_mid_prefill(session)
    assert failure.value.observed.startswith(
        "in the 'preempted-prefill-reuse' data run ('a1' was preempted mid-prefill with 40 of its 64 prompt tokens "
        "computed, then resumed), request 'b' generated "
    )
    assert "it ran on wrong KV: the load of 'b' at step " in session.tags.untag(failure.value.observed)
    assert failure.value.fix is not None and failure.value.fix.startswith(RESUMED_PREFILL_FIX)


def test_request_finished_all_groups_calling_request_finished_is_one_call(fixtures: str) -> None:
    """vLLM calls request_finished_all_groups or request_finished, never both: KV030 counts vLLM's call."""
    report = run_native_conformance(
        f"{fixtures}:AllGroupsDelegatingConnector", config={"store": uuid.uuid4().hex}, select="KV03*"
    )
    assert report.failed == 0 and report.result("KV030").status == "passed", _failed(report)


def test_a_vllm_connector_whose_server_outlives_every_run_never_meets_a_request_id_twice(fixtures: str) -> None:
    """Two validate invocations against one server keyed by request id (LMCache's multi-process one): every
    scenario and data run gives vLLM request ids of its own."""
    name = f"{fixtures}:RequestIdServerConnector"
    for _ in range(2):
        report = run_native_conformance(name, config={"store": uuid.uuid4().hex}, select="KV0[14]0")
        assert report.load_error is None and report.failed == 0, _failed(report)
        assert report.result("KV010").status == report.result("KV040").status == "passed"


def test_the_harness_records_the_kv_cache_layout_before_any_connector_exists() -> None:
    """vLLM 0.33's workers record the engine core's layout in the cache config before building connectors, and
    connectors read it there: the harness does the same, for its KV caches' layout (vLLM's LBHNC)."""
    from kvconn_vllm.testing.harness import make_scheduler

    scheduler = make_scheduler(None)
    assert scheduler.vllm_config.cache_config.kv_cache_layout == "LBHNC"
