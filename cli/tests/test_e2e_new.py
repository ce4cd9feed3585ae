"""End to end: ``kvconn new`` scaffolds a plugin that installs with pip and passes ``kvconn validate``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvconn.testing import StoreConformance

from .conftest import REPO, RunKvconn

RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.parametrize(
    ("flags", "first_field", "doc"),
    [
        ((), "namespace", "a namespace of its own within the engine's (runs that must not share blocks)"),
        (("--hooks",), "log_calls", "Log every hook call at DEBUG level."),
    ],
    ids=["store", "hooks"],
)
def test_new_plugin_installs_lists_and_validates(
    tmp_path: Path,
    run_kvconn: RunKvconn,
    pip_install: Callable[[Path, Path], None],
    make_env: Callable[..., dict[str, str]],
    flags: tuple[str, ...],
    first_field: str,
    doc: str,
) -> None:
    created = run_kvconn("new", "e2e-store", *flags, cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    project = tmp_path / "kvconn-e2e-store"
    assert (project / "src" / "kvconn_e2e_store" / "__init__.py").is_file()
    assert "ConnectorConformance" in (project / "tests" / "test_conformance.py").read_text()
    assert 'e2e-store = "kvconn_e2e_store:E2eStoreConnector"' in (project / "pyproject.toml").read_text()

    # The generated code is lint-clean under the project's own rules.
    lint = subprocess.run(
        [str(RUFF), "check", "--config", str(REPO / "pyproject.toml"), str(project)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout

    site = tmp_path / "site"
    pip_install(project, site)
    # A temporary directory and a home of the test's own: what the runs below leave there is measured.
    temp, home = tmp_path / "tmp", tmp_path / "home"
    temp.mkdir()
    home.mkdir()
    env = make_env(site, KVCONN_PLUGINS="e2e-store", TMPDIR=str(temp), HOME=str(home))

    info = json.loads(run_kvconn("info", "e2e-store", "--json", env=env).stdout)
    assert info["status"] == "ok" and info["distribution"] == "kvconn-e2e-store"
    assert info["config"][0]["name"] == first_field
    assert info["config"][0]["doc"] == doc

    # Twice: the store is files that outlive the run, and each run gets a fresh store (KV045 stays green).
    for _ in range(1 if flags else 2):
        validated = run_kvconn("validate", "e2e-store", "--json", env=env)
        assert validated.returncode == 0, validated.stdout + validated.stderr
        report = json.loads(validated.stdout)["connectors"][0]
        assert report["name"] == "e2e-store" and report["failed"] == 0 and report["passed"] > 0
    assert not list(temp.iterdir()), f"validate left {sorted(p.name for p in temp.iterdir())} in the temp directory"
    assert not list(home.iterdir()), "validate wrote the connector's default store (it must use the run's own)"

    # The generated one-line conformance test collects every check; three of them run here (and, for a store
    # connector, two checks of the store contract).
    selection = "KV001 or KV032 or KV045 or write_once or unreachable"
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", selection],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert not list(temp.iterdir()), f"the tests left {sorted(p.name for p in temp.iterdir())} in the temp directory"
    # the store contract (tests/test_store.py: every StoreConformance test), two of them selected here; KV045
    # does not apply to the hooks template (it does not save)
    store_tests = 0 if flags else sum(name.startswith("test_") for name in dir(StoreConformance))
    outcome = "2 passed, 1 skipped" if flags else "5 passed"
    deselected = report["passed"] + report["skipped"] + store_tests - (3 if flags else 5)
    assert f"{outcome}, {deselected} deselected" in tests.stdout, tests.stdout


def test_new_into_a_given_dir(tmp_path: Path, run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("new", "x_cache", "--dir", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "src" / "kvconn_x_cache" / "__init__.py").is_file()
    assert "kvconn validate x_cache" in proc.stderr and not proc.stdout


def test_new_refuses_a_non_empty_dir(tmp_path: Path, run_kvconn: RunKvconn) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    proc = run_kvconn("new", "mystore", "--dir", str(tmp_path))
    assert proc.returncode == 2
    assert "not empty" in proc.stderr and proc.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_new_refuses_a_bad_name(tmp_path: Path, run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("new", "My Store", cwd=tmp_path)
    assert proc.returncode == 2
    assert "'My Store'" in proc.stderr and "try 'my_store'" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_new_warns_when_the_name_is_taken(tmp_path: Path, run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("new", "dummy", cwd=tmp_path)
    assert proc.returncode == 0
    assert "warning" in proc.stderr and "already installed" in proc.stderr
