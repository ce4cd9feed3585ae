"""End to end: ``kvconn validate`` on real plugins, broken plugins, class paths; every exit code."""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvconn.testing.conformance import list_checks
from kvconn_cli.output import SCHEMA_VERSION

from .conftest import RunKvconn

#: A pattern selecting the first few checks: keeps the runs that are not about the whole suite short.
FIRST_CHECK = list_checks()[0]


def _reports(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    document = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
    assert set(document) == {"schema_version", "connectors"} and document["schema_version"] == SCHEMA_VERSION
    return {r["name"]: r for r in document["connectors"]}


def test_validate_dummy_passes_with_json_and_junit(tmp_path: Path, run_kvconn: RunKvconn) -> None:
    junit = tmp_path / "results.xml"
    proc = run_kvconn("validate", "dummy", "--json", "--junit", str(junit))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = _reports(proc)["dummy"]
    assert set(report) == {"name", "passed", "failed", "skipped", "checks"}
    checks = report["checks"]
    assert [c["id"] for c in checks] == [c.id for c in list_checks()]
    assert all(set(c) == {"id", "name", "status", "message"} for c in checks)
    assert report["failed"] == 0 and report["passed"] == sum(c["status"] == "passed" for c in checks) > 0
    assert report["skipped"] == sum(c["status"] == "skipped" for c in checks)
    assert all(c["message"] for c in checks if c["status"] == "skipped")  # a skip says why

    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "dummy"
    assert suite.get("tests") == str(len(checks)) and suite.get("failures") == "0"
    assert "Traceback" not in proc.stderr


def test_validate_table_and_progress(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("validate", "dummy", "--check", FIRST_CHECK.id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(line for line in proc.stdout.splitlines() if FIRST_CHECK.id in line)
    assert "passed" in row and FIRST_CHECK.name in row
    assert "dummy: ok  1 passed, 0 failed, 0 skipped" in proc.stdout
    assert "validating dummy (1 checks)" in proc.stderr  # not a terminal: one progress line per connector


def test_validate_finds_a_lifecycle_bug(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    # KV032 is the check for the leaky plugin's bug: it never forgets a finished request.
    proc = run_kvconn("validate", "e2e-leaky", "--check", "KV032", "--json", env=broken_env)
    assert proc.returncode == 1
    report = _reports(proc)["e2e-leaky"]
    (check,) = report["checks"]
    assert (check["id"], check["status"], report["failed"]) == ("KV032", "failed", 1)
    assert "get_num_tracked_requests" in check["message"] and "fix: " in check["message"]
    assert "Traceback" not in proc.stderr


def test_validate_a_plugin_that_does_not_import(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    proc = run_kvconn("validate", "e2e-import-error", "--json", env=broken_env)
    assert proc.returncode == 1
    report = _reports(proc)["e2e-import-error"]
    assert report["checks"] == [] and "libfoo.so.1" in report["load_error"]
    assert "Traceback" not in proc.stderr

    text = run_kvconn("validate", "e2e-import-error", env=broken_env)
    assert text.returncode == 1
    assert "e2e-import-error: cannot load:" in text.stdout and "rerun with --debug" in text.stderr

    for debug in (
        run_kvconn("validate", "e2e-import-error", "--debug", env=broken_env),
        run_kvconn("validate", "e2e-import-error", env={**broken_env, "KVCONN_DEBUG": "1"}),
    ):
        assert debug.returncode == 1
        assert "Traceback" in debug.stderr and "ImportError: libfoo.so.1" in debug.stderr


def test_validate_all_reports_every_connector(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    # KV004 starts the connector: the noisy one prints, and the JSON on stdout must not suffer.
    proc = run_kvconn("validate", "--all", "--json", "--check", "KV004", env=broken_env)
    assert proc.returncode == 1  # the broken plugins cannot load
    assert "noisy connector started" in proc.stderr
    reports = _reports(proc)
    assert reports["dummy"]["failed"] == 0 and "load_error" not in reports["dummy"]
    broken = {n: r["load_error"] for n, r in reports.items() if "load_error" in r}
    assert set(broken) == {"e2e-import-error", "e2e-exits", "e2e-bad-api"}
    assert "sys.exit(3)" in broken["e2e-exits"]  # a plugin that exits does not end the run
    assert reports["e2e-leaky"]["passed"] == 1 and reports["e2e-noisy"]["passed"] == 1


def test_a_plugin_writing_to_file_descriptor_1_leaves_the_json_intact(
    run_kvconn: RunKvconn, broken_env: dict[str, str]
) -> None:
    # os.write(1) at import and in start_load_kv, and C stdio's printf (buffered until exit) in the hook.
    proc = run_kvconn("validate", "e2e-fd-writer", "--json", env=broken_env)
    assert proc.returncode == 0, proc.stderr
    assert _reports(proc)["e2e-fd-writer"]["failed"] == 0
    for written in ("raw bytes on fd 1 at import", "raw bytes on fd 1 in start_load_kv", "buffered C stdio"):
        assert written in proc.stderr


def test_validate_all_of_healthy_plugins(run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]) -> None:
    proc = run_kvconn("validate", "--all", "--json", "--check", FIRST_CHECK.id, env=make_env(KVCONN_PLUGINS="dummy"))
    assert proc.returncode == 0, proc.stderr
    assert list(_reports(proc)) == ["dummy"]


@pytest.mark.parametrize("option", [["--module"], []])
def test_validate_a_class_path(run_kvconn: RunKvconn, option: list[str]) -> None:
    proc = run_kvconn("validate", *option, "kvconn_dummy:DummyConnector", "--check", FIRST_CHECK.id, "--json")
    assert proc.returncode == 0, proc.stderr
    assert _reports(proc)["kvconn_dummy:DummyConnector"]["passed"] == 1


def test_validate_a_class_path_that_does_not_import(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("validate", "--module", "no_such_module_xyz:Connector")
    assert proc.returncode == 1
    assert "no_such_module_xyz" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_validate_config_is_used(run_kvconn: RunKvconn, tmp_path: Path) -> None:
    path = tmp_path / "dummy.json"
    path.write_text('{"record_calls": false}')
    for args in (["--config", '{"record_calls": false}'], ["--config-file", str(path)]):
        proc = run_kvconn("validate", "dummy", *args, "--check", FIRST_CHECK.id, "--json")
        assert proc.returncode == 0, proc.stderr


def test_validate_with_an_engine_that_is_not_available(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("validate", "dummy", "--engine", "vllm", "--check", FIRST_CHECK.id, "--json")
    assert proc.returncode == 1
    assert "vllm" in _reports(proc)["dummy"]["load_error"]
    assert "Traceback" not in proc.stderr


def test_validate_a_vllm_connector_without_vllm_is_a_load_error(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("validate", "--engine", "vllm", "--vllm-connector", "ExampleConnector", "--json")
    assert proc.returncode == 1
    assert "vLLM is not installed" in _reports(proc)["ExampleConnector"]["load_error"]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "name the connectors to validate, or pass --all, --module package.module:ClassName or --vllm-connector"),
        (["--vllm-connector", "ExampleConnector"], "pass --engine vllm too"),
        (["--engine", "vllm", "--vllm-connector", "pkg.mod:"], "'pkg.mod:'"),
        (["--engine", "vllm", "--vllm-connector", "X", "--config-factory", "m:f"], "kvconn connectors only"),
        (["dumy"], "'dumy'"),
        (["dummy", "--config", "{bad"], "--config is not valid JSON"),
        (["dummy", "--config", "[1]"], "must be a JSON object"),
        (["dummy", "--config", "{}", "--config-file", "x.json"], "exclusive"),
        (["dummy", "--config-file", "/nonexistent/cfg.json"], "cannot read --config-file"),
        (["dummy", "--config", '{"record_calls": "maybe"}'], "field 'record_calls'"),
        (["dummy", "--config", '{"recrod_calls": true}'], "valid fields: record_calls"),
        (["--module", "not_a_path"], "is not a connector path"),
        (["dummy", "--check", "no-such-check"], "matches no check"),
        (["dummy", "--junit", "/nonexistent/dir/out.xml", "--check", FIRST_CHECK.id], "cannot write --junit"),
    ],
)
def test_validate_usage_errors(run_kvconn: RunKvconn, args: list[str], message: str) -> None:
    proc = run_kvconn("validate", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("kvconn: error: ") and proc.stderr.count("\n") == 1  # one line
    assert message in proc.stderr


def test_validate_bad_options_are_usage_errors(run_kvconn: RunKvconn) -> None:
    assert run_kvconn("validate", "dummy", "--frobnicate").returncode == 2
    assert run_kvconn("validate", "dummy", "--engine", "tensorrt").returncode == 2


def test_validate_unknown_name_suggests(run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]) -> None:
    proc = run_kvconn("validate", "dumy", env=make_env())
    assert proc.returncode == 2
    assert "did you mean 'dummy'" in proc.stderr and proc.stderr.count("\n") == 1


FIXTURES = Path(__file__).resolve().parents[2] / "sdk" / "tests" / "conformance" / "fixtures"


def test_a_config_factory_lets_validate_catch_a_load_that_skips_missing_blocks(
    run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]
) -> None:
    """A fresh namespace per run makes the store lose what the scheduler saw; without a factory, a worker side
    in another process does (its process-memory store is empty there)."""
    env = make_env(FIXTURES, KVCONN_PLUGINS="dummy")
    broken = ("validate", "--module", "kvconn_conformance_fixtures.broken:SkipsMissing", "--check", "KV04*")
    proc = run_kvconn(*broken, "--config-factory", "kvconn.testing.memory_connector:fresh_namespace", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "its worker's store (a fresh namespace) had none of them, it reported no block failed" in proc.stdout
    proc = run_kvconn(*broken, "--json", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "with its worker side in another process (as vLLM's multiprocess engine runs it)" in proc.stdout
    proc = run_kvconn(*broken[:3], "--config-factory", "kvconn.testing.memory_connector:nope", env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "kvconn: error: --config-factory 'kvconn.testing.memory_connector:nope': module "
        "'kvconn.testing.memory_connector' has no function 'nope'"
    ]


def test_wait_s_is_the_bound_a_stalled_load_is_waited_for_and_the_message_names_it(
    run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]
) -> None:
    env = make_env(FIXTURES, KVCONN_PLUGINS="dummy")
    never = ("validate", "--module", "kvconn_conformance_fixtures.livelock:NeverFinishesLoads", "--check", "KV040")
    proc = run_kvconn(*never, "--wait-s", "0.5", "--json", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (check,) = json.loads(proc.stdout)["connectors"][0]["checks"]
    assert "the wait bound is 0.5 s: for a store that is merely slow, raise it with --wait-s" in check["message"]
    proc = run_kvconn(*never, "--wait-s", "0", env=env)
    assert proc.returncode == 2 and "--wait-s" in proc.stderr
