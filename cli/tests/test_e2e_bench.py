"""End to end: ``kvconn bench`` runs each benchmark script (``--quick``: a smoke run, no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import REPO, RunKvconn


@pytest.mark.parametrize(
    "name", ["block-state", "wire", "host-dispatch", "scheduler-scaling", "startup", "connector-scaling"]
)
def test_each_benchmark_runs_quick_and_writes_json(run_kvconn: RunKvconn, tmp_path: Path, name: str) -> None:
    out = tmp_path / "result.json"
    proc = run_kvconn("bench", name, "--quick", "--json", str(out), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["quick"] is True and doc["machine"]["cpus"] >= 1
    assert doc["rows"] and all(len(row) == len(doc["columns"]) for row in doc["rows"])
    assert doc["targets"] and all(isinstance(t["met"], bool) for t in doc["targets"])
    assert doc["benchmark"] in proc.stdout


def test_bench_lists_benchmarks_and_rejects_unknown_names(run_kvconn: RunKvconn, tmp_path: Path) -> None:
    listing = run_kvconn("bench", cwd=REPO)
    assert listing.returncode == 0 and "block-state" in listing.stdout and "offload" in listing.stdout
    unknown = run_kvconn("bench", "nope", cwd=REPO)
    assert unknown.returncode == 2 and "unknown benchmark 'nope'" in unknown.stderr
    missing = run_kvconn("bench", "wire", "--dir", str(tmp_path), cwd=REPO)
    assert missing.returncode == 2 and "no benchmark scripts found" in missing.stderr
