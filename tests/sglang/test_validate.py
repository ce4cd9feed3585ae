"""`kvconn validate --engine sglang`: the storage checks through SGLang's controller, same report and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KVCONN = Path(sys.executable).parent / "kvconn"
HERE = Path(__file__).parent


def _validate(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(KVCONN), "validate", "--engine", "sglang", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_a_store_connector_passes_every_sglang_check() -> None:
    result = _validate("mooncake", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    assert [c["id"] for c in report["checks"]] == [f"SG00{i}" for i in range(1, 8)]
    assert report["passed"] == 7


def test_a_store_that_lies_fails_with_what_was_observed() -> None:
    result = _validate("--module", "bad_stores:LyingConnector", "--json")
    assert result.returncode == 1
    (report,) = json.loads(result.stdout)["connectors"]
    failed = {c["id"]: c["message"] for c in report["checks"] if c["status"] == "failed"}
    assert "SG001" in failed and "observed" in failed["SG001"] and "fix:" in failed["SG001"]


def test_a_connector_that_is_not_a_store_gets_a_clear_message() -> None:
    result = _validate("dummy")
    assert result.returncode == 1
    assert "is not a kvconn store connector" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
