"""Bandwidth of the offload connector's save and load paths vs one contiguous copy.

Runs the plugin's own copy code (``kvconn_offload.BlockCopier`` over
``CopyPlan``s, the views the worker builds with ``wide_rows``) for one step
that saves (device blocks -> host pool) and one that loads (host pool ->
device blocks) ``--tokens`` tokens in every layer, at scattered device block
ids, and compares each with a single contiguous ``copy_`` of the same bytes -
the machine's memcpy limit (on CUDA: torch's own pinned host<->device
``copy_``). Host blocks are the lowest free slots, as the connector's manager
hands them out on an empty pool. Prints medians over ``--repeats`` and, with
``--json FILE``, writes them.

    python benchmarks/offload_bandwidth.py [--device cuda] [--layers 8] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvconn_offload import BlockCopier, CopyPlan, wide_rows


def _timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench(block_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = (2, block_tokens, args.kv_heads, args.head_dim)
    n = args.tokens // block_tokens
    num_blocks = 4 * n
    gen = torch.Generator().manual_seed(block_tokens)
    kv = [torch.randn((num_blocks, *shape), generator=gen).to(torch.float16).to(device) for _ in range(args.layers)]
    pool = torch.zeros((args.layers, n, *shape), dtype=torch.float16, pin_memory=cuda)
    rows = [wide_rows(t) for t in kv]
    copier = BlockCopier(wide_rows(pool, 2))
    device_ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    plan = CopyPlan.build(device_ids, list(range(n)), device)
    stream = torch.cuda.Stream() if cuda else None
    nbytes = args.layers * n * kv[0][0].numel() * kv[0].element_size()
    # baseline: one contiguous copy of the same bytes (host<->device on CUDA, host->host on CPU)
    src = torch.randn(nbytes // 2, generator=gen).to(torch.float16).to(device)
    dst = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=cuda)

    def on_stream(fn: Callable[[], None]) -> Callable[[], None]:
        if stream is None:
            return fn

        def run() -> None:
            with torch.cuda.stream(stream):
                fn()

        return run

    def save() -> None:
        for layer, r in enumerate(rows):
            copier.save(layer, r, plan)

    def load() -> None:
        for layer, r in enumerate(rows):
            copier.load(layer, r, plan)

    def out() -> None:
        dst.copy_(src, non_blocking=cuda)

    def back() -> None:
        src.copy_(dst, non_blocking=cuda)

    runs: dict[str, Callable[[], None]] = {"save": on_stream(save), "load": on_stream(load)}
    if cuda:
        runs.update(contiguous_d2h=out, contiguous_h2d=back)
    else:
        runs["contiguous"] = out
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.warmup):
        for fn in runs.values():
            _timed(fn, sync)
    for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits every variant alike
        for name, fn in runs.items():
            times[name].append(_timed(fn, sync))
    gbps = {name: nbytes / statistics.median(t) / 1e9 for name, t in times.items()}
    save_ref = gbps["contiguous_d2h" if cuda else "contiguous"]
    load_ref = gbps["contiguous_h2d" if cuda else "contiguous"]
    # check the round trip moved the right bytes
    assert torch.equal(pool[0, 0].to(device), kv[0][plan.device[0].item()])
    return {
        "block_tokens": block_tokens,
        "blocks": n,
        "host_runs": len(plan.runs),
        "mib": nbytes / 2**20,
        **{f"{name}_gbps": round(v, 2) for name, v in gbps.items()},
        "save_ratio": round(gbps["save"] / save_ref, 3),
        "load_ratio": round(gbps["load"] / load_ref, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="where the KV caches live: cpu or cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens saved/loaded per step, in every layer")
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.tokens, args.block_tokens, args.repeats, args.warmup = 2, 256, [16], 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [bench(bt, args) for bt in args.block_tokens]
    machine = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.processor() or platform.machine()}"
    print(
        f"offload bandwidth: {args.layers} layers x {args.kv_heads} KV heads x head dim {args.head_dim}, float16, "
        f"{args.tokens} tokens per step, device {args.device} ({machine}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    keys = [k for k in results[0] if k.endswith("_gbps")]
    header = [
        "block tokens",
        "blocks",
        "MiB",
        *[k.removesuffix("_gbps") + " GB/s" for k in keys],
        "save/ref",
        "load/ref",
    ]
    print(" | ".join(header))
    for r in results:
        cells = [
            r["block_tokens"],
            r["blocks"],
            f"{r['mib']:.0f}",
            *[r[k] for k in keys],
            r["save_ratio"],
            r["load_ratio"],
        ]
        print(" | ".join(str(c) for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
