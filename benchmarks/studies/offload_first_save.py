"""The offload pool's first save into each slot: a pool committed up front against a fresh ``torch.empty`` one.

A pageable host pool from ``torch.empty`` has no pages until something writes
them, so the first save into each slot faults its pages in, inside the step
that saves (on an evicted turn in ``vllm_e2e.py`` that step is the one the
user waits on). The offload worker now allocates its pool with
``torch.zeros``: the pages are committed when the KV caches are registered.
This times :class:`kvconn_offload.BlockCopier` saving ``blocks`` blocks of
every layer into slots never written before, on both pools, in interleaved
rounds (each round a fresh slot range on each pool), next to the same save
into slots written before (the steady state, what neither pool pays twice).

    python benchmarks/studies/offload_first_save.py [--json out.json] [--quick]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from benchlib import Bench, parse_args
from benchlib.vllm_engine import FULL_BLOCK_SHAPE as BLOCK_SHAPE

from kvconn_offload import BlockCopier, CopyPlan, wide_rows


def first_saves(pool: Any, kv: list[Any], blocks: int) -> Callable[[int], float]:
    """Round ``r``: the seconds to save ``blocks`` blocks of every layer into host blocks ``r * blocks ...``."""
    copier = BlockCopier(wide_rows(pool, 2))
    device = list(range(1, blocks + 1))

    def save(round_: int) -> float:
        plan = CopyPlan.build(device, list(range(round_ * blocks, (round_ + 1) * blocks)))
        start = time.perf_counter()
        for layer, rows in enumerate(kv):
            copier.save(layer, rows, plan)
        return time.perf_counter() - start

    return save


def main() -> int:
    args = parse_args(__doc__)
    layers, rounds = (2, 5) if args.quick else (12, 41)
    sizes = (2, 8) if args.quick else (2, 32)  # an evicted turn's new blocks; a first turn's 1,024 tokens
    bench = Bench(
        f"offload: first saves into a pool committed up front vs a fresh torch.empty pool ({layers} layers, "
        f"64 KiB blocks, median of {rounds} interleaved rounds)",
        ["blocks per layer", "MiB per step", "committed ms", "empty ms", "written before ms", "empty / committed"],
    )
    ratios: dict[int, float] = {}
    for blocks in sizes:
        kv = [wide_rows(torch.randn(blocks + 1, *BLOCK_SHAPE)) for _ in range(layers)]
        shape = (layers, rounds * blocks, *BLOCK_SHAPE)
        committed = first_saves(torch.zeros(shape), kv, blocks)
        empty = first_saves(torch.empty(shape), kv, blocks)
        times: dict[str, list[float]] = {"committed": [], "empty": [], "again": []}
        for round_ in range(rounds):
            times["committed"].append(committed(round_))
            times["empty"].append(empty(round_))
            times["again"].append(committed(round_))  # the same slots, now written: no page to fault in
        ms = {who: statistics.median(t) * 1e3 for who, t in times.items()}
        ratios[blocks] = statistics.median(e / c for e, c in zip(times["empty"], times["committed"], strict=True))
        mib = layers * blocks * kv[0][0].numel() * kv[0].element_size() / (1 << 20)
        bench.row(blocks, mib, ms["committed"], ms["empty"], ms["again"], ratios[blocks])
    bench.target(
        "a committed pool's first save is no slower than a fresh pool's",
        all(r >= 1.0 for r in ratios.values()),
        ", ".join(f"{b} blocks: empty {r:.2f}x committed" for b, r in ratios.items()),
    )
    bench.notes.append("empty / committed: the median over rounds of each round's ratio (both ran back to back)")
    nbytes = (16 if args.quick else 256) << 20
    start = time.perf_counter()
    torch.zeros(nbytes, dtype=torch.uint8)
    per_gib = (time.perf_counter() - start) * (1 << 30) / nbytes
    bench.notes.append(
        f"what committing costs once, when the KV caches are registered: {per_gib:.2f} s per GiB of pool"
    )
    return bench.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
