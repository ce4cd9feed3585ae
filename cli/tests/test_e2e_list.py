"""End to end: ``kvconn list`` as a user runs it (the installed executable, real entry points)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvconn_cli.output import SCHEMA_VERSION

from .conftest import RunKvconn


def _connectors(proc: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)  # stdout holds the JSON document and nothing else
    assert set(document) == {"schema_version", "connectors"} and document["schema_version"] == SCHEMA_VERSION
    return {c["name"]: c for c in document["connectors"]}


def test_list_json_describes_the_dummy(run_kvconn: RunKvconn) -> None:
    dummy = _connectors(run_kvconn("list", "--json"))["dummy"]
    assert dummy == {
        "name": "dummy",
        "target": "kvconn_dummy:DummyConnector",
        "distribution": "kvconn-dummy",
        "version": dummy["version"],
        "status": "ok",
        "roles": ["scheduler", "worker"],
        "saves": False,
        "loads": False,
        "api_version": "1.0",
    }
    assert dummy["version"]


def test_list_every_installed_plugin(run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]) -> None:
    """Unfiltered, as a user runs it: whatever else is installed, the listing works and dummy is ok."""
    connectors = _connectors(run_kvconn("list", "--json", env=make_env()))
    assert connectors["dummy"]["status"] == "ok"
    assert all(c["status"] == "ok" or c["status"].startswith("broken: ") for c in connectors.values())


def test_list_table(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("list")
    assert proc.returncode == 0, proc.stderr
    # stdout is not a terminal: plain columns, one line per connector, a header underlined with dashes
    lines = proc.stdout.splitlines()
    assert lines[1].split()[:3] == ["name", "status", "roles"] and set(lines[2]) == {"-", " "}
    row = next(line for line in lines if line.startswith("dummy "))
    assert row.split()[:4] == ["dummy", "ok", "scheduler", "worker"] and "kvconn-dummy" in row


def test_list_reports_broken_plugins_and_keeps_going(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    connectors = _connectors(run_kvconn("list", "--json", env=broken_env))
    assert connectors["dummy"]["status"] == "ok"
    assert connectors["e2e-noisy"]["status"] == "ok"  # its print went to stderr, the JSON parsed
    status = {name: connectors[name]["status"] for name in ("e2e-import-error", "e2e-exits", "e2e-bad-api")}
    assert status["e2e-import-error"].startswith("broken: ")
    assert "libfoo.so.1" in status["e2e-import-error"] and "kvconn-e2e-broken" in status["e2e-import-error"]
    assert "sys.exit(3)" in status["e2e-exits"]
    assert "2.0" in status["e2e-bad-api"] and "1.0" in status["e2e-bad-api"]
    for name in status:
        assert "\n" not in status[name]
        assert connectors[name]["roles"] is None
        assert connectors[name]["distribution"] == "kvconn-e2e-broken"


def test_list_table_with_broken_plugins(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    proc = run_kvconn("list", env=broken_env)
    assert proc.returncode == 0
    assert "broken: " in proc.stdout and "libfoo.so.1" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_list_honours_disable_list(
    run_kvconn: RunKvconn, broken_plugins_site: Path, make_env: Callable[..., dict[str, str]]
) -> None:
    env = make_env(broken_plugins_site, KVCONN_DISABLE_PLUGINS="e2e-noisy, e2e-exits, offload, mooncake")
    names = set(_connectors(run_kvconn("list", "--json", env=env)))
    assert {"dummy", "e2e-leaky"} <= names
    assert not names & {"e2e-noisy", "e2e-exits"}


def test_list_honours_allow_list(
    run_kvconn: RunKvconn, broken_plugins_site: Path, make_env: Callable[..., dict[str, str]]
) -> None:
    env = make_env(broken_plugins_site, KVCONN_PLUGINS="dummy,e2e-leaky")
    assert set(_connectors(run_kvconn("list", "--json", env=env))) == {"dummy", "e2e-leaky"}


def test_list_with_nothing_installed_says_so(run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]) -> None:
    proc = run_kvconn("list", env=make_env(KVCONN_PLUGINS="nothing-here"))
    assert proc.returncode == 0
    assert "No connectors installed" in proc.stderr and "KVCONN_PLUGINS" in proc.stderr
    assert _connectors(run_kvconn("list", "--json", env=make_env(KVCONN_PLUGINS="nothing-here"))) == {}


def test_list_does_not_import_torch(make_env: Callable[..., dict[str, str]]) -> None:
    # Only the dummy: this is about the CLI's own imports (each plugin answers for its own).
    code = (
        "import sys\n"
        "from kvconn_cli.app import main\n"
        "try:\n    main(['list', '--json'])\nexcept SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n"
    )
    env = make_env(KVCONN_PLUGINS="dummy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("NO-TORCH")
