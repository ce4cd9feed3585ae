"""`kvconn bench sglang` runs here (smoke sizes) and writes finite figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

KVCONN = Path(sys.executable).parent / "kvconn"
REPO = Path(__file__).resolve().parents[2]


def test_bench_sglang_quick(tmp_path: Path) -> None:
    out = tmp_path / "sglang.json"
    proc = subprocess.run(
        [str(KVCONN), "bench", "sglang", "--quick", "--json", str(out), "--dir", str(REPO / "benchmarks")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    labels = [row[0] for row in doc["rows"]]
    assert labels[0] == "mooncake (embedded)"
    assert all(math.isfinite(x) for row in doc["rows"] for x in row[1:])
