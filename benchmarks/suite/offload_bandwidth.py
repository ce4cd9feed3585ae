"""Bandwidth of the offload connector's worker hooks vs one contiguous copy of the same bytes.

Times the ``offload`` connector's worker side as an engine drives it for one
many-request step: ``start_load_kv(metadata)``, ``save_kv_layer`` per layer,
``wait_for_save``, ``get_finished`` (and on CUDA a device synchronize, so
the side-stream copies are inside the time). A *save step* stores
``--tokens`` tokens of every layer, a *load step* loads them back into other
device blocks; both are split into requests of ``--request-blocks`` blocks
at scattered device block ids. Host slots are either ``contiguous`` (as the
manager hands out the lowest free slots on an empty pool: one run across all
requests) or ``scattered`` (a random subset of a pool twice that size: the
fragmented-pool fallback). The reference is one contiguous ``copy_`` of the
same bytes: the machine's memcpy limit on CPU (``copy_`` uses all of torch's
threads), torch's own pinned host<->device ``copy_`` on CUDA. On CPU with
several torch threads the same hooks also run with torch set to one thread
("1 thread"), in the same rounds: what the copies gain from torch's threads
(long runs go through torch's kernels, which split them over those). Rounds
are interleaved (save, load, reference in turn, so a noisy neighbour hits
each alike); a ratio is the median over rounds of reference time / hook time
in the same round. The loaded KV is checked bit-exact against what was
saved.

    python benchmarks/suite/offload_bandwidth.py [--device cuda] [--layers 8] [--threads 1] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from benchlib import Bench, arg_parser

from kvconn import ConnectorContext, KVCacheGroupSpec, load_connector
from kvconn_offload import BlockTransfer, OffloadMetadata

TARGET = 0.85  # of the contiguous copy: one-run host slots
TARGET_SCATTERED = 0.7


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _transfers(dev: list[int], slots: list[int], per: int) -> list[BlockTransfer]:
    """One transfer per request of ``per`` blocks; a slot's key is its number (multiple 1: host block = slot)."""
    return [
        BlockTransfer(
            f"req-{i // per}",
            [dev[i : i + per]],
            [slots[i : i + per]],
            slots=slots[i : i + per],
            keys=[s.to_bytes(8, "little") for s in slots[i : i + per]],
        )
        for i in range(0, len(dev), per)
    ]


def bench(block_tokens: int, layout: str, args: argparse.Namespace) -> dict[str, Any]:
    """Save/load steps of ``block_tokens``-token blocks with host slots laid out as ``layout``."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = args.tokens // block_tokens
    pool_slots = n if layout == "contiguous" else 2 * n
    names = tuple(f"layer.{i}" for i in range(args.layers))
    context = ConnectorContext(block_size=block_tokens, kv_cache_groups=(KVCacheGroupSpec(names),))
    worker = load_connector("offload", role="worker", config={"pool_blocks": pool_slots}, context=context).side
    gen = torch.Generator().manual_seed(block_tokens)
    shape = (2 * n + 1, 2, block_tokens, args.kv_heads, args.head_dim)
    kv = {name: torch.randn(shape, generator=gen).to(torch.float16).to(device) for name in names}
    worker.register_kv_caches(kv)
    perm = torch.randperm(2 * n, generator=gen).add_(1).tolist()  # block 0 is the null block
    saved, loaded = perm[:n], perm[n:]
    slots = list(range(n)) if layout == "contiguous" else sorted(torch.randperm(2 * n, generator=gen)[:n].tolist())
    save_meta = OffloadMetadata(store_seq=0, stores=_transfers(saved, slots, args.request_blocks))
    load_meta = OffloadMetadata(loads=_transfers(loaded, slots, args.request_blocks))
    nbytes = args.layers * n * kv[names[0]][0].numel() * 2
    src = torch.randn(nbytes // 2, generator=gen).to(torch.float16).to(device)
    dst = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=cuda)

    def step(meta: OffloadMetadata) -> None:
        worker.start_load_kv(meta)
        for name in names:
            worker.save_kv_layer(name)
        worker.wait_for_save()
        sync()  # CUDA: the copies are done, so this get_finished completes the job (its slots become loadable)
        worker.get_finished()

    def save() -> None:
        save_meta.store_seq += 1
        step(save_meta)

    runs: dict[str, Callable[[], None]] = {"save": save, "load": lambda: step(load_meta)}
    single = not cuda and torch.get_num_threads() > 1
    if single:  # the same hooks with torch on one thread: what its kernels' threads buy (long runs go through them)
        runs["save 1 thread"] = _on_one_thread(save)
        runs["load 1 thread"] = _on_one_thread(lambda: step(load_meta))
    if cuda:
        runs["d2h"] = lambda: dst.copy_(src, non_blocking=True)
        runs["h2d"] = lambda: src.copy_(dst, non_blocking=True)
    else:
        runs["contiguous"] = lambda: dst.copy_(src)
    save()  # the slots hold their keys before the first load
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.warmup + args.repeats):
        for name, fn in runs.items():
            elapsed = _timed(fn, sync)
            if r >= args.warmup:
                times[name].append(elapsed)
    ref_save, ref_load = ("d2h", "h2d") if cuda else ("contiguous", "contiguous")
    stats = worker.get_kv_connector_stats()
    calls = args.warmup + args.repeats
    each = 2 if single else 1  # steps per round of each kind
    assert stats["blocks_saved"] == n * (each * calls + 1) and stats["blocks_loaded"] == n * each * calls, stats
    assert not worker.get_block_ids_with_load_errors()
    for t in kv.values():
        assert torch.equal(t[saved], t[loaded]), "loaded KV differs from what was saved"
    worker.shutdown()
    return {
        "block_tokens": block_tokens,
        "layout": layout,
        "requests": len(save_meta.stores),
        "blocks": n,
        "mib": nbytes / 2**20,
        **{f"{name}_gbps": nbytes / statistics.median(ts) / 1e9 for name, ts in times.items()},
        "save_ratio": _ratio(times[ref_save], times["save"]),
        "load_ratio": _ratio(times[ref_load], times["load"]),
        **(
            {
                "save_1_thread_ratio": _ratio(times[ref_save], times["save 1 thread"]),
                "load_1_thread_ratio": _ratio(times[ref_load], times["load 1 thread"]),
            }
            if single
            else {}
        ),
    }


def _on_one_thread(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            fn()
        finally:
            torch.set_num_threads(threads)

    return run


def _ratio(reference: list[float], measured: list[float]) -> float:
    return statistics.median(r / m for r, m in zip(reference, measured, strict=True))


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--device", default="cpu", help="where the KV caches live: cpu or cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens saved/loaded per step, in every layer")
    parser.add_argument("--request-blocks", type=int, default=4, help="blocks per request")
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.tokens, args.block_tokens, args.repeats, args.warmup = 2, 256, [16], 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    results = [bench(bt, layout, args) for bt in args.block_tokens for layout in ("contiguous", "scattered")]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    gbps = [k for k in results[0] if k.endswith("_gbps")]
    single = "load_1_thread_ratio" in results[0]
    columns = ["block tokens", "host slots", "requests", "MiB", *[k.removesuffix("_gbps") + " GB/s" for k in gbps]]
    table = Bench(
        f"offload worker hooks vs a contiguous copy: {args.layers} layers x {args.kv_heads} KV heads x head dim "
        f"{args.head_dim}, float16, {args.tokens} tokens per step in {args.request_blocks}-block requests, "
        f"device {args.device} ({where}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved rounds",
        [*columns, "save/ref", "load/ref", *(["1 thread: save/ref", "1 thread: load/ref"] if single else [])],
    )
    for r in results:
        cells = [r["block_tokens"], r["layout"], r["requests"], r["mib"], *[r[k] for k in gbps]]
        singles = [r["save_1_thread_ratio"], r["load_1_thread_ratio"]] if single else []
        table.row(*cells, r["save_ratio"], r["load_ratio"], *singles)
        goal = TARGET if r["layout"] == "contiguous" else TARGET_SCATTERED
        worst = min(r["save_ratio"], r["load_ratio"])
        table.target(
            f"save and load >= {goal} of the reference ({r['block_tokens']}-token blocks, {r['layout']} slots)",
            worst >= goal,
            f"save {r['save_ratio']:.3f}, load {r['load_ratio']:.3f}",
        )
    return table.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
