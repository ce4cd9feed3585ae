"""run_conformance's contract: reports, selection, progress, load errors, drivers, crashes."""

from __future__ import annotations

import json

import pytest

from kvconn.testing.conformance import (
    Check,
    CheckResult,
    ConformanceFailure,
    DriverSpec,
    ReferenceDriver,
    available_drivers,
    list_checks,
    register_driver,
    run_conformance,
)
from kvconn.testing.conformance.catalog import _CHECKS
from kvconn.testing.conformance.driver_registry import _DRIVERS


def test_ids_are_unique_stable_and_documented() -> None:
    checks = list_checks()
    assert [c.id for c in checks] == sorted({c.id for c in checks})
    assert len({c.name for c in checks}) == len(checks)
    for c in checks:
        assert c.id.startswith("KV") and len(c.id) == 5
        assert c.doc and c.fix and "Catches" in c.doc, c.id
    assert {c.id for c in checks} >= {"KV001", "KV005", "KV011", "KV012", "KV013", "KV014", "KV021", "KV040", "KV041"}


def test_select_matches_ids_and_names_and_reports_progress() -> None:
    seen: list[CheckResult] = []
    report = run_conformance("dummy", select="*fill*", on_result=seen.append)
    assert [r.id for r in report.results] == ["KV011"] == [r.id for r in seen]
    assert [r.id for r in run_conformance("dummy", select="kv00*").results] == [
        "KV001", "KV002", "KV003", "KV004", "KV005", "KV006", "KV007",
    ]  # fmt: skip


def test_report_to_dict_is_json() -> None:
    report = run_conformance("dummy", select="KV04*")
    data = json.loads(json.dumps(report.to_dict()))
    assert len(report.results) == sum(c.id.startswith("KV04") for c in list_checks()) >= 5
    assert data == {
        "name": "dummy",
        "passed": 0,
        "failed": 0,
        "skipped": len(report.results),
        "checks": [{"id": r.id, "name": r.name, "status": "skipped", "message": r.message} for r in report.results],
    }


@pytest.mark.parametrize(
    ("connector", "expected"),
    [
        ("no-such-connector", "no connector named 'no-such-connector' is installed"),
        ("no_such_module:Thing", "failed to import module 'no_such_module'"),
        ("kvconn_conformance_fixtures.broken:NoSuchClass", "has no attribute 'NoSuchClass'"),
    ],
)
def test_load_errors_are_reports_not_exceptions(connector: str, expected: str) -> None:
    report = run_conformance(connector)
    assert report.results == [] and not report.ok
    assert report.load_error is not None and expected in report.load_error
    assert report.to_dict()["load_error"] == report.load_error


def test_a_connector_class_is_checked_by_the_name_it_is_importable_from() -> None:
    from kvconn_conformance_fixtures.broken import NewBlocksOnly

    by_class = run_conformance(NewBlocksOnly, select="KV011")
    by_name = run_conformance("kvconn_conformance_fixtures.broken:NewBlocksOnly", select="KV011")
    assert by_class.name == by_name.name == "kvconn_conformance_fixtures.broken:NewBlocksOnly"
    assert [(r.id, r.status) for r in by_class.results] == [("KV011", "failed")]


def test_a_connector_that_is_neither_a_name_nor_a_class_is_a_load_error_saying_what_to_pass() -> None:
    report = run_conformance(42)  # type: ignore[arg-type]
    assert report.load_error == (
        "connector must be an installed connector's name, 'package.module:Class' or a class, not int 42"
    )


def test_bad_user_config_is_a_load_error() -> None:
    report = run_conformance("dummy", config={"record_calls": "yes please"})
    assert report.load_error == "invalid config for connector 'dummy': field 'record_calls': expected bool, got str"


def test_unknown_driver_is_a_load_error() -> None:
    report = run_conformance("dummy", driver="no-such-engine")
    assert report.load_error is not None and "no conformance driver named 'no-such-engine'" in report.load_error


def test_the_vllm_driver_without_its_adapter_names_the_distribution_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvconn.testing.conformance import driver_registry as driver

    monkeypatch.setattr(driver, "entry_points", lambda **_: [])  # as where kvconn-vllm is not installed
    with pytest.raises(LookupError, match=r"named 'vllm' .*; install kvconn-vllm, which ships it"):
        driver.get_driver("vllm")


def test_a_driver_that_cannot_run_here_is_a_load_error_saying_why() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        report = run_conformance("dummy", driver="vllm")
        assert report.load_error is not None and "vLLM is not installed in this environment" in report.load_error
    else:
        pytest.skip("vLLM is installed here: the vLLM tier (tests/vllm) runs this driver")


def test_registered_driver_runs_the_scheduler_checks() -> None:
    built: list[DriverSpec] = []

    def factory(spec: DriverSpec) -> ReferenceDriver:
        built.append(spec)
        return ReferenceDriver(spec)

    register_driver("counting", factory)
    try:
        assert "counting" in available_drivers()
        report = run_conformance("dummy", select="KV01*", driver="counting")
    finally:
        del _DRIVERS["counting"]
    assert report.ok and report.passed == 6
    assert {s.shape.block_size for s in built} == {16, 256} and any(s.shape.num_blocks == 14 for s in built)


def test_a_check_that_crashes_is_a_failure() -> None:
    def explode(session: object) -> None:
        raise KeyError("boom")

    _CHECKS["KV999"] = Check("KV999", "explodes", "Catches nothing.", "none", frozenset(), explode)
    try:
        report = run_conformance("dummy", select="KV999")
    finally:
        del _CHECKS["KV999"]
    assert report.results == [CheckResult("KV999", "explodes", "failed", "KeyError: 'boom'")]


def test_conformance_failure_message() -> None:
    exc = ConformanceFailure("x happened", "do y")
    assert isinstance(exc, AssertionError) and str(exc) == "observed x happened; fix: do y"


def test_every_check_is_in_the_catalogue() -> None:
    from pathlib import Path

    catalogue = (Path(__file__).parents[3] / "docs" / "checks.md").read_text()
    for c in list_checks():
        assert f"### {c.id} {c.name}\n" in catalogue, f"{c.id} {c.name} is not documented in docs/checks.md"
