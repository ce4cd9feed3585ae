"""One full ``vllm.LLM`` run of the example's workload; prints ``RESULT <json>``.

Run as a script (vLLM's engine core and workers start with spawn, so the entry
point is guarded): ``python engine_run.py SPEC_JSON``. SPEC keys: ``model``
(a model directory), ``connector`` (``None`` for no connector, a name or a list),
``config`` (``kvconn_config``), ``short_name`` (load through vLLM's registry
name ``"kvconn"`` instead of the module path), ``tp`` (tensor-parallel size),
``load_failure_policy`` (default ``"fail"``; ``"recompute"`` for a test whose
loads are meant to fail).

The engine, the workload and the counters are examples/vllm_offline.py's (what
a connector author runs), with two differences that make a test stricter: a
connector error raises (``kvconn_on_error`` ``"raise"``) and a failed load
fails its request (``kv_load_failure_policy`` ``"fail"``) instead of being
recomputed into the right tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from vllm_offline import make_llm, run_workload, transfer_config


def run(spec: dict[str, Any]) -> dict[str, Any]:
    kv_transfer = None
    if spec.get("connector"):
        kv_transfer = transfer_config(
            spec["connector"],
            spec.get("config"),
            short_name=bool(spec.get("short_name")),
            on_error="raise",
            load_failure_policy=spec.get("load_failure_policy", "fail"),
        )
    return run_workload(make_llm(spec["model"], kv_transfer, tp=spec.get("tp", 1)))


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
