"""The vLLM end-to-end benchmark's figures, from made-up engine runs (no vLLM needed): table shape and targets."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _module() -> Any:
    sys.path.insert(0, str(BENCHMARKS))  # its `from benchlib import Bench`
    try:
        spec = importlib.util.spec_from_file_location("vllm_e2e", BENCHMARKS / "vllm_e2e.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("vllm_e2e", module)  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _run(sizes: Any, ttft: float, hits: int, wall: float, tokens: list[int]) -> dict[str, Any]:
    requests = [
        {"conv": c, "turn": t, "ttft": ttft if t else 1.0, "ttft_cpu": ttft if t else 1.0, "tokens": tokens,
         "prompt_len": sizes.prompt_len(t), "cached": 0}
        for t in range(sizes.turns) for c in range(sizes.conversations)
    ]  # fmt: skip
    return {"requests": requests, "wall_s": wall, "external_hit_tokens": hits, "memcpy_bytes_per_s": 1 << 30,
            "loadavg_1min": [1.0, 1.0]}  # fmt: skip


def test_report_rows_match_the_columns_and_targets_follow_the_figures(tmp_path: Path) -> None:
    e2e = _module()
    sizes = e2e.QUICK
    evicted = (sizes.turns - 1) * sizes.conversations
    loaded = 1 << 20  # bytes per evicted turn: 1 ms at 1 GiB/s
    hits = evicted * loaded // sizes.shape.kv_bytes_per_token
    runs = {
        "none": _run(sizes, 1.0, 0, 10.0, [5]),
        "fit": _run(sizes, 0.100, 0, 5.0, [5]),
        "offload": _run(sizes, 0.1015, hits, 5.1, [5]),  # 1.5 ms over fit: within 2x memcpy
        "mooncake": _run(sizes, 0.2, hits, 12.0, [6]),  # 2x fit, slower than none, different tokens
    }
    chat = e2e.summarise(runs, sizes)
    noreuse = e2e.summarise_noreuse({n: r for n, r in runs.items() if n != "fit"})
    bench = e2e.Bench("t", e2e.COLUMNS)
    e2e.report(bench, chat, noreuse)
    assert [len(row) for row in bench.rows] == [len(e2e.COLUMNS)] * 4
    verdicts = [(t["target"][:25], t["met"]) for t in bench.targets]
    assert verdicts == [
        ("offload: evicted-turn TTF", True),
        ("offload: whole-run throug", True),
        ("offload: time over fit <=", True),
        ("mooncake (real master): e", False),  # 2x fit
        ("no reuse: every connector", False),  # mooncake: 10 s / 12 s of none's rate
        ("every run's tokens equal ", False),  # mooncake's differ
    ]
    out = tmp_path / "e2e.json"
    bench.finish(argparse.Namespace(quick=True, json=out))
    assert json.loads(out.read_text())["rows"][0][0] == "none"


def test_the_gpu_form_without_a_cuda_vllm_cannot_run_and_says_what_it_needs(capsys: Any) -> None:
    """``--device cuda`` (scripts/gpu-check.sh) in an interpreter without a CUDA vLLM: exit 2, and why."""
    e2e = _module()
    assert e2e.main(["--device", "cuda", "--python", sys.executable, "--quick"]) == e2e.CANNOT_RUN
    err = capsys.readouterr().err
    assert "has no CUDA vLLM engine" in err and "a CUDA build of vLLM" in err
