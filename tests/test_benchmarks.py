"""Every benchmark script still runs: ``--quick`` (smoke sizes) as a subprocess, figures finite, no timing asserted.

A benchmark that rots (an API it calls changed) fails here, not when someone
next wants a figure. Scripts are discovered, so a new one is covered without
editing this file.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: The suite ``kvconn bench`` runs and the studies (their shared ``benchlib`` is no script).
SCRIPTS = sorted([*BENCHMARKS.glob("suite/*.py"), *BENCHMARKS.glob("studies/*.py")], key=lambda p: p.name)
#: Exit status of a benchmark that cannot run on this machine (it says why on stderr), e.g. Mooncake without root.
CANNOT_RUN = 2


def _numbers(doc: Any) -> list[float]:
    if isinstance(doc, bool):
        return []
    if isinstance(doc, int | float):
        return [float(doc)]
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _numbers(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _numbers(v)]
    return []


def test_every_benchmark_is_covered() -> None:
    names = {p.stem for p in SCRIPTS}
    assert {"offload_bandwidth", "mooncake_throughput", "scheduler_scaling", "wire"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_runs_quick_with_finite_figures(script: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=script.parent,
    )
    if proc.returncode == CANNOT_RUN and "cannot run" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-4000:]
    numbers = _numbers(json.loads(out.read_text()))
    assert numbers, "the benchmark wrote no figures"
    assert all(math.isfinite(x) for x in numbers), [x for x in numbers if not math.isfinite(x)]
    assert proc.stdout.strip()
