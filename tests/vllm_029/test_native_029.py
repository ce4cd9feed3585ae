"""vLLM 0.29.0's own ``MooncakeStoreConnector`` under ``kvconn validate --engine vllm --vllm-connector``.

0.29 is the last release whose ``kv_connector_block_state`` is a dict of only the requests that got new
blocks this step: on the step that fills a block (a prefill chunk ending on a block boundary) the request is
missing, and the store connector asserts. 0.30+ offers every scheduled request lazily
(``tests/vllm/test_native.py`` checks 0.33's connector passes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from kvconn_vllm.testing.native import run_native_conformance


def test_mooncake_store_connector_fails_block_fill_with_vllms_own_assertion() -> None:
    report = run_native_conformance("MooncakeStoreConnector", select="KV01[01]")
    assert report.load_error is None
    results = {r.id: r for r in report.results}
    assert results["KV010"].status == "passed", results["KV010"].message  # the standard scenarios do not hit it
    block_fill = results["KV011"]
    assert block_fill.status == "failed"
    assert "AssertionError: Missing current block table for store request r0" in block_fill.message
    assert "48-token prompt under a 40-token budget" in block_fill.message
    assert "use vLLM 0.30 or later" in block_fill.message  # the fix
    assert any("stand-in (MooncakeStoreStandInWorker)" in n for n in report.notes)


def test_the_cli_reports_it_and_exits_1() -> None:
    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM 0.29 venv"
    result = subprocess.run(
        [kvconn, "validate", "--engine", "vllm", "--vllm-connector", "MooncakeStoreConnector", "--check", "KV011",
         "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    (check,) = report["checks"]
    assert check["status"] == "failed" and "Missing current block table" in check["message"]
    assert "torch.cuda.Event" in report["notes"][0]
