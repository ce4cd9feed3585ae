"""The vLLM end-to-end benchmark's figures, from made-up engine runs (no vLLM needed): table shape and targets."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"


def _module() -> Any:
    sys.path.insert(0, str(BENCHMARKS))  # its `from benchlib import Bench` (the suite's link to benchlib)
    try:
        spec = importlib.util.spec_from_file_location("vllm_e2e", BENCHMARKS / "vllm_e2e.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("vllm_e2e", module)  # its dataclasses look their module up
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _run(
    sizes: Any, ttft: float, hits: int, wall: float, tokens: list[int], own: float | None = None
) -> dict[str, Any]:
    """A made-up run: every request takes ``wall / requests`` seconds, ``own`` of them inside the connector."""
    count = sizes.turns * sizes.conversations
    requests = [
        {"conv": c, "turn": t, "ttft": ttft if t else 1.0, "ttft_cpu": ttft if t else 1.0, "tokens": tokens,
         "prompt_len": sizes.prompt_len(t), "cached": 0, "seconds": wall / count, "own_s": own,
         "own_by_call_s": {} if own is None else {"start_load_kv": own * 0.75, "get_num_new_matched_tokens": own / 4},
         "own_total_s": own}
        for t in range(sizes.turns) for c in range(sizes.conversations)
    ]  # fmt: skip
    return {"requests": requests, "wall_s": wall, "external_hit_tokens": hits, "memcpy_bytes_per_s": 1 << 30,
            "memcpy_one_thread_bytes_per_s": 1 << 29, "loadavg_1min": [1.0, 1.0]}  # fmt: skip


def test_report_rows_match_the_columns_and_targets_follow_the_figures(tmp_path: Path) -> None:
    e2e = _module()
    sizes = e2e.QUICK
    evicted = (sizes.turns - 1) * sizes.conversations
    loaded = 1 << 20  # bytes per evicted turn: 1 ms at 1 GiB/s
    hits = evicted * loaded // sizes.shape.kv_bytes_per_token
    runs = {
        "none": _run(sizes, 1.0, 0, 10.0, [5]),
        "fit": _run(sizes, 0.100, 0, 5.0, [5]),
        # 1.5 ms over fit, 1.5 ms its own: within 2x memcpy; 1.5 ms of a 1.3 s request (0.1%)
        "offload": _run(sizes, 0.1015, hits, 5.1, [5], own=0.0015),
        # 2x fit, slower than none, different tokens; 50 ms of a 3 s request (1.7%)
        "mooncake": _run(sizes, 0.2, hits, 12.0, [6], own=0.05),
    }
    chat = e2e.summarise(runs, sizes)
    # vLLM with a connector that does nothing: 10.2 s, its own time 0.1 ms
    bare = _run(sizes, 1.0, 0, 10.2, [5], own=0.0001)
    noreuse = e2e.summarise_noreuse({**{n: r for n, r in runs.items() if n != "fit"}, "bare": bare})
    bench = e2e.Bench("t", e2e.COLUMNS)
    e2e.report(bench, chat, noreuse)
    assert [len(row) for row in bench.rows] == [len(e2e.COLUMNS)] * 5
    bare_share = 0.0001 / (10.2 / (sizes.turns * sizes.conversations)) * 100
    assert bench.rows[4][0] == "bare" and bench.rows[4][-3:] == pytest.approx([10.0 / 10.2, 10.0 / 10.2, bare_share])
    verdicts = [(t["target"][:25], t["met"]) for t in bench.targets]
    assert verdicts == [
        ("offload: evicted-turn TTF", True),
        ("offload: whole-run throug", True),
        ("offload: time over fit <=", True),
        ("offload: its own time per", True),
        ("mooncake (real master): e", False),  # 2x fit
        ("no reuse: every connector", False),  # mooncake: 10 s / 12 s of none's rate
        ("no reuse: every connector", False),  # mooncake: 10.2 s / 12 s of bare's rate (offload's 10.2 / 5.1)
        ("no reuse: every connector", False),  # mooncake: its own time 1.7% of its requests'
        ("every run's tokens equal ", False),  # mooncake's differ
    ]
    assert chat["offload"]["own_by_call_ms"] == pytest.approx(
        {"get_num_new_matched_tokens": 0.375, "start_load_kv": 1.125}
    )
    own = e2e.COLUMNS.index("own ms/turn")
    assert chat["none"]["own_ms_p50"] is None and bench.rows[0][own] == "-"
    # 1.5 ms, a memcpy of ~1 ms on all threads and ~2 ms on one
    assert bench.rows[2][own : own + 3] == pytest.approx([1.5, 1.5, 0.75], rel=0.05)
    request_s = 12.0 / (sizes.turns * sizes.conversations)
    assert noreuse["mooncake"]["own_share_pct"] == pytest.approx(0.05 / request_s * 100)
    assert noreuse["mooncake"]["paired_vs_none"] == pytest.approx(10.0 / 12.0)
    floor = next(t["measured"] for t in bench.targets if "0.99x none's" in t["target"])
    assert "bare" not in floor.partition(";")[0] and "(bare): 0.980x" in floor  # the floor, not a connector judged
    out = tmp_path / "e2e.json"
    bench.finish(argparse.Namespace(quick=True, json=out))
    assert json.loads(out.read_text())["rows"][0][0] == "none"


def test_no_reuse_paired_throughput_moves_by_one_sample_where_a_slow_spell_moves_the_whole_run() -> None:
    """One prompt of the connector's run hit a slow spell (3x): the whole run's rate drops, the paired one holds."""
    e2e = _module()
    sizes = e2e.QUICK
    runs = {"none": _run(sizes, 1.0, 0, 9.0, [5]), "offload": _run(sizes, 1.0, 0, 9.0, [5], own=0.001)}
    slow = runs["offload"]["requests"][0]
    slow["seconds"] *= 3  # 1.5 s -> 4.5 s
    runs["offload"]["wall_s"] = sum(r["seconds"] for r in runs["offload"]["requests"])
    noreuse = e2e.summarise_noreuse(runs)
    assert noreuse["offload"]["vs_none"] == pytest.approx(9.0 / 12.0)
    assert noreuse["offload"]["paired_vs_none"] == pytest.approx(1.0)


def test_the_gpu_form_without_a_cuda_vllm_cannot_run_and_says_what_it_needs(capsys: Any) -> None:
    """``--device cuda`` (scripts/gpu-check.sh) in an interpreter without a CUDA vLLM: exit 2, and why."""
    e2e = _module()
    assert e2e.main(["--device", "cuda", "--python", sys.executable, "--quick"]) == e2e.CANNOT_RUN
    err = capsys.readouterr().err
    assert "has no CUDA vLLM engine" in err and "a CUDA build of vLLM" in err
