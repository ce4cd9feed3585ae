"""examples/vllm_offline.py runs as docs/vllm.md says, and reports exact tokens, loads and kvconn's counters."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import EXAMPLE, RUN_TIMEOUT_S, engine_env


def test_the_offline_example_is_exact_loads_and_shows_kvconns_counters() -> None:
    # vLLM's default engine (engine core in a spawned process): the example's entry point is guarded for it.
    argv = [sys.executable, str(EXAMPLE), "--connector", "offload", "--json"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=engine_env(multiprocess=True), timeout=2 * RUN_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["tokens_match"] is True
    assert summary["tokens_loaded_by_connector"] > 0 and summary["preemptions"] > 0
    counters = summary["kvconn_counters"]
    assert 0 < counters["offload.blocks_loaded"] <= counters["offload.blocks_saved"]
    assert not any(key.split(".", 1)[1].startswith("_") for key in counters)  # private gauges stay private
