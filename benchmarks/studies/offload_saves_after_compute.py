"""Offload's CPU saves between layers' compute, against the same saves at the end of the step (what it does now).

Inside vLLM on CPU, a save made right after a layer's compute ran 4-5x slower
than the same copy made in isolation (benchmarks/history/2026-log.md, "Offload's CPU
saves at the end of the step"): the first copy right after a layer's matrix
products is the slow one, whatever reads or writes memory before it. This
drives one step the way an engine does: ``layers`` layers, each a matrix
product standing in for its compute (a ``[tokens, 1024] @ [1024, 4096]`` fp32
product, of the order of one layer of ``vllm_e2e.py``'s model: hidden 1024, MLP
2 x 2816), then writes the step's blocks of that layer's KV cache, with the save either

* **per layer**: :class:`kvconn_offload.BlockCopier` right after each layer
  (offload's schedule until this change), or
* **at the end**: the ``offload`` connector's own worker hooks
  (``start_load_kv``, ``save_kv_layer`` per layer, ``wait_for_save``), which
  on CPU now copy every layer's blocks in ``wait_for_save``,

and times only the saves (the hooks' time), in interleaved rounds, for an
evicted turn's new blocks (2 per layer) and a longer prefill's (16). The
saved blocks are checked bit-exact against the KV caches.

    python benchmarks/studies/offload_saves_after_compute.py [--json out.json] [--quick]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from benchlib import Bench, parse_args
from benchlib.vllm_engine import FULL_BLOCK_SHAPE as BLOCK_SHAPE

from kvconn import ConnectorContext, KVCacheGroupSpec, load_connector
from kvconn_offload import BlockCopier, BlockTransfer, CopyPlan, OffloadMetadata, wide_rows

HIDDEN, MLP = 1024, 4096


Schedule = tuple[Callable[[], float], torch.Tensor]


def schedules(layers: int, blocks: int, tokens: int) -> tuple[dict[str, Schedule], Callable[[torch.Tensor], bool]]:
    """Per schedule, the step (it returns the seconds spent saving) and the pool it saves into; and a check that a
    pool holds the KV caches' blocks of the step that ran last."""
    names = tuple(f"layer.{i}" for i in range(layers))
    context = ConnectorContext(block_size=BLOCK_SHAPE[1], kv_cache_groups=(KVCacheGroupSpec(names),))
    worker = load_connector("offload", role="worker", config={"pool_blocks": blocks}, context=context).side
    kv = {name: torch.zeros(2 * blocks + 1, *BLOCK_SHAPE) for name in names}
    worker.register_kv_caches(kv)
    weights = [torch.randn(HIDDEN, MLP) for _ in names]
    x = torch.randn(tokens, HIDDEN)
    device, slots = list(range(1, blocks + 1)), list(range(blocks))
    pool = torch.zeros(layers, blocks, *BLOCK_SHAPE)
    copier, plan = BlockCopier(wide_rows(pool, 2)), CopyPlan.build(device, slots)
    rows = [wide_rows(t) for t in kv.values()]
    keys = [s.to_bytes(8, "little") for s in slots]
    meta = OffloadMetadata(store_seq=0, stores=[BlockTransfer("r", [device], [slots], slots=slots, keys=keys)])

    def compute(layer: int) -> None:  # the layer's matrix product, then its KV for this step
        x @ weights[layer]
        kv[names[layer]][1 : blocks + 1] += 1.0

    def per_layer() -> float:
        spent = 0.0
        for layer in range(layers):
            compute(layer)
            start = time.perf_counter()
            copier.save(layer, rows[layer], plan)
            spent += time.perf_counter() - start
        return spent

    def hooks() -> float:
        meta.store_seq += 1
        start = time.perf_counter()
        worker.start_load_kv(meta)
        spent = time.perf_counter() - start
        for layer, name in enumerate(names):
            compute(layer)
            start = time.perf_counter()
            worker.save_kv_layer(name)
            spent += time.perf_counter() - start
        start = time.perf_counter()
        worker.wait_for_save()
        worker.get_finished()
        return spent + time.perf_counter() - start

    def holds_last_step(saved: torch.Tensor) -> bool:
        return all(torch.equal(saved[i], t[1 : blocks + 1]) for i, t in enumerate(kv.values()))

    return {"per layer": (per_layer, pool), "at the end": (hooks, worker.pool)}, holds_last_step


def main() -> int:
    args = parse_args(__doc__)
    layers, rounds, tokens = (2, 5, 64) if args.quick else (12, 31, 256)
    bench = Bench(
        f"offload on CPU: a step's saves between {layers} layers' compute vs at the end of the step "
        f"(64 KiB blocks, median of {rounds} interleaved rounds)",
        ["blocks per layer", "MiB per step", "per layer ms", "at the end ms", "per layer / at the end"],
    )
    ratios: dict[int, float] = {}
    for blocks in (2, 16):
        steps, holds_last_step = schedules(layers, blocks, tokens)
        times: dict[str, list[float]] = {who: [] for who in steps}
        for round_ in range(rounds + 1):  # round 0 warms up
            for who in steps if round_ % 2 else reversed(steps):
                step, saved = steps[who]
                seconds = step()
                if not holds_last_step(saved):
                    raise SystemExit(f"{blocks} blocks, {who}: a saved block differs from the KV cache")
                if round_:
                    times[who].append(seconds)
        ratios[blocks] = statistics.median(p / e for p, e in zip(times["per layer"], times["at the end"], strict=True))
        mib = layers * blocks * math.prod(BLOCK_SHAPE) * 4 / (1 << 20)
        ms = {who: statistics.median(t) * 1e3 for who, t in times.items()}
        bench.row(blocks, mib, ms["per layer"], ms["at the end"], ratios[blocks])
    bench.target(
        "saves at the end of the step are no slower than between layers",
        all(r >= 1.0 for r in ratios.values()),
        ", ".join(f"{b} blocks: per layer {r:.2f}x at the end" for b, r in ratios.items()),
    )
    bench.notes.append(
        f"torch threads: {torch.get_num_threads()}; per layer / at the end: the median over rounds of each round's "
        "ratio (the two ran back to back, the order alternating)"
    )
    return bench.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
