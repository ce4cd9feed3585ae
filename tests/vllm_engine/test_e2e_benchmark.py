"""``kvconn bench vllm-e2e --quick``: the end-to-end benchmark's smoke run, through the real CLI, with its plot.

Every configuration runs a real engine on the tiny sizes; the benchmark itself
checks each run's tokens against the connector-less run, and this test holds
it to that and to loads having happened (no timing asserted). Mooncake's real
master needs a network namespace (root): without one the benchmark runs the
other configurations.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mooncake_or_none(request: pytest.FixtureRequest) -> types.ModuleType | None:
    """The netns harness when Mooncake's real master can run here, else ``None`` (that configuration is left out)."""
    try:
        harness: types.ModuleType = request.getfixturevalue("netns_harness")
    except pytest.skip.Exception:
        return None
    return harness


def test_vllm_e2e_quick_through_the_cli(tmp_path: Path, mooncake_or_none: types.ModuleType | None) -> None:
    out, png = tmp_path / "e2e.json", tmp_path / "ttft.png"
    configs = "none,fit,bare,offload," + ("mooncake," if mooncake_or_none else "") + "example"
    argv = [sys.executable, "-m", "kvconn_cli", "bench", "vllm-e2e", "--quick", "--json", str(out),
            "--plot", str(png), "--configs", configs]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["quick"] is True and set(doc["chat"]) == set(configs.split(",")) - {"bare"}
    assert set(doc["noreuse"]) == set(configs.split(",")) - {"fit"}  # bare: vLLM's floor, no reuse only
    assert all(s["tokens_equal_none"] for s in [*doc["chat"].values(), *doc["noreuse"].values()])
    for name in ("offload", *(["mooncake"] if mooncake_or_none else [])):
        assert doc["chat"][name]["loaded_mib_per_evicted_turn"] > 0, f"{name} loaded nothing on evicted turns"
    # vLLM's own cache evicted the history: without a connector an evicted turn reuses at most the system prompt.
    assert doc["chat"]["none"]["vllm_cached_tokens_median"] <= doc["sizes"]["system"]
    assert doc["chat"]["fit"]["vllm_cached_tokens_median"] > doc["sizes"]["system"]
    figures = [x for row in doc["rows"] for x in row if isinstance(x, float)]
    assert figures and all(math.isfinite(x) for x in figures)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "vLLM end to end" in proc.stdout


def test_multiprocess_runs_bind_the_model_to_the_same_cores_with_a_connector_or_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU backend reserves a core more when a kv_transfer_config is set; ``--multiprocess`` evens it out.

    Without that, the model of every connector's engine would run on other cores than ``none``'s and ``fit``'s
    (a core fewer, or on two cores a core more), and the benchmark would compare engines, not connectors. Run
    through vLLM's own thread-binding manager, with what it reads of the engine's config.
    """
    from vllm.config import KVTransferConfig
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "suite"))
    for key, value in importlib.import_module("vllm_e2e").child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)

    def cores(kv_transfer_config: KVTransferConfig | None) -> tuple[list[list[int]], list[int]]:
        parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None, _api_process_count=1)
        manager = OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv_transfer_config))
        return manager.cpu_lists, manager.reserved_cpu_list

    with_connector = cores(KVTransferConfig(kv_connector="KVConnConnector", kv_role="kv_both"))
    assert with_connector == cores(None), "a connector's engine gets other cores for its model than no connector's"


def test_offload_hit_while_decoding_quick(tmp_path: Path) -> None:
    """On host KV caches offload's default loads a hit in the step that computes it; ``load_async: true`` waits one."""
    out = tmp_path / "hit.json"
    script = REPO / "benchmarks" / "studies" / "offload_hit_while_decoding.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=900, cwd=script.parent)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    doc = json.loads(out.read_text())
    steps = {mode: {r["steps_to_first"] for run in runs for r in run} for mode, runs in doc["runs"].items()}
    assert steps == {"async": {2}, "default": {1}}
    (loaded,) = [t for t in doc["targets"] if t["target"].startswith("every hit loaded its prefix")]
    assert loaded["met"], loaded["measured"]  # a hit in every engine, the same first token in both modes
