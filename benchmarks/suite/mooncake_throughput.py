"""Mooncake connector throughput (kvconn.store over the real client) against raw Mooncake calls on the same store.

Starts a real ``mooncake_master`` inside a throw-away network namespace (root,
iproute2 and the ``store`` extra needed; see plugins/mooncake/tests/MOONCAKE_NOTES.md)
and re-runs itself inside it. Per round it moves the same bytes three ways:

* store connector save / load: the ``mooncake`` connector's worker side, integrity
  on (``wait_for_save``: seal each value over the block's rows in the KV caches, one
  ``batch_put_from_multi_buffers`` of header + rows, no staging copy;
  ``start_load_kv``, sync (Mooncake's default): one ``batch_get_into`` into staging,
  verify every value, copy the verified ones into the KV caches; async: one
  ``batch_get_into_multi_buffers`` of each value's header and its block's rows, straight
  into the KV caches, verified there, timed until ``get_finished`` reports it);
* raw batched: one ``batch_put_from`` / ``batch_get_into`` of contiguous values of
  the same size (issue 22's targets: the connector at >= 0.85 / >= 0.75 of these);
* per block: one ``put_from`` / ``get_into`` call per block.
* raw, hashed: the raw batched call with an XXH3-128 pass over every value
  before the put / after the get, no kvconn code: what any design that checks
  every byte once, one pass after the other, can reach on this machine.

Each round uses fresh keys (puts never overwrite), runs the saves and then the
loads in an order rotated every round (no row always follows the same one), checks
that the connector's load is bit-exact in every layer, and then removes every key
(so the store needs one round's worth of memory). Round 0 warms up and is not
counted. Prints a Markdown table: the median time of each row, and its ratio to
the raw contiguous call, the median of the per-round ratios (paired rounds cancel
most of the drift of a shared machine). ``--gap-ms`` idles that long before each
timed call, as an engine's puts and gets come between steps of compute (caches
and the client's threads go cold). ``--first-touch`` keeps every round's values,
so each put lands in pages of the segment that were never written, as an engine's
puts do until its segment has filled once; with ``--cold`` too, the connector does
not fault its segment in at connect time (``warm_segment: false``), so those puts pay
the page faults. Usage: ``python benchmarks/suite/mooncake_throughput.py [--blocks N]
[--layers L] [--rounds R] [--gap-ms MS] [--first-touch] [--cold] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from benchlib import CANNOT_RUN, mooncake_netns


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def inner(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvconn import ConnectorContext, KVCacheGroupSpec, KVConnectorRole
    from kvconn.store import StoreBlock, StoreMetadata
    from kvconn_mooncake import MooncakeConnector

    n, layers, bs, heads, dim = args.blocks, args.layers, 16, 8, 128
    names = tuple(f"layer.{i}" for i in range(layers))
    context = ConnectorContext(block_size=bs, kv_cache_groups=(KVCacheGroupSpec(names),))
    config = MooncakeConnector.Config(
        master_server_address=os.environ["MC_MASTER_ADDR"],
        metadata_server=os.environ["MC_METADATA_URL"],
        local_hostname=os.environ["MC_LOCAL_HOSTNAME"],
        global_segment_size=args.segment_mib << 20,
        local_buffer_size=64 << 20,
        timeout_s=30.0,
        warm_segment=not args.cold,
    )
    worker: Any = MooncakeConnector(config, role=KVConnectorRole.WORKER, context=context).side
    kv = {name: torch.randn((3 * n + 1, 2, bs, heads, dim)).half() for name in names}
    worker.register_kv_caches(kv)
    store = worker.guard.call("open", lambda store: store)  # the store the connector uses, and its client
    client = store.call(lambda client: client)
    value_bytes = layers * kv[names[0]][0].numel() * 2
    staging = torch.randint(0, 255, (n, value_bytes), dtype=torch.uint8)
    client.register_buffer(staging.data_ptr(), staging.numel())
    ptrs, sizes = [staging[i].data_ptr() for i in range(n)], [value_bytes] * n
    rows = [memoryview(row) for row in staging.numpy()]
    times: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (staging buffers, threads) and is not counted
        hashes = [f"plugin-{r}-{i}".encode().ljust(32, b".") for i in range(n)]
        saves = StoreMetadata(saves=[StoreBlock("s", 0, 1 + i, h) for i, h in enumerate(hashes)], load_async=False)
        loads = StoreMetadata(loads=[StoreBlock("l", 0, 1 + n + i, h) for i, h in enumerate(hashes)], load_async=False)
        async_loads = StoreMetadata(loads=[StoreBlock("a", 0, 1 + 2 * n + i, h) for i, h in enumerate(hashes)])
        raw, single = [f"raw-{r}-{i}" for i in range(n)], [f"one-{r}-{i}" for i in range(n)]
        hashed = [f"hashed-{r}-{i}" for i in range(n)]

        def plugin_save(meta: StoreMetadata = saves) -> None:
            worker.start_load_kv(meta)
            worker.wait_for_save()
            worker.get_finished(set())

        def plugin_load_async(meta: StoreMetadata = async_loads) -> None:
            worker.start_load_kv(meta)
            while not worker.get_finished(set())[1]:  # an engine asks once a step; a tighter poll only steals the GIL
                time.sleep(0.001)

        def hashed_put(keys: list[str] = hashed) -> None:
            _hash_each(rows)
            client.batch_put_from(keys, ptrs, sizes)

        def hashed_get(keys: list[str] = hashed) -> None:  # keys of its own: none read twice in a round
            client.batch_get_into(keys, ptrs, sizes)
            _hash_each(rows)

        def per_block(call: Callable[[str, int, int], int], keys: list[str] = single) -> None:
            for key, ptr in zip(keys, ptrs, strict=True):
                call(key, ptr, value_bytes)

        saves_and_loads: dict[str, Callable[[], Any]] = {
            "save: store connector": plugin_save,
            "save: raw batch_put_from": partial(client.batch_put_from, raw, ptrs, sizes),
            "save: put_from per block": partial(per_block, client.put_from),
            "save: raw hash, then batch_put_from (no kvconn)": hashed_put,
            "load: store connector, sync (staged)": partial(worker.start_load_kv, loads),
            "load: store connector, async (in place)": plugin_load_async,
            "load: raw batch_get_into": partial(client.batch_get_into, raw, ptrs, sizes),
            "load: get_into per block": partial(per_block, client.get_into),
            "load: raw batch_get_into, then hash (no kvconn)": hashed_get,
        }
        labels = list(saves_and_loads)
        for label in _rotated(labels[:4], r) + _rotated(labels[4:], r):
            time.sleep(args.gap_ms / 1000)  # untimed: an engine's calls come between steps of compute
            seconds = _timed(saves_and_loads[label])
            if r:
                times.setdefault(label, []).append(seconds)
        stats = worker.get_kv_connector_stats()
        assert stats.get("blocks_saved") == n and stats.get("blocks_loaded") == 2 * n, stats
        assert worker.get_block_ids_with_load_errors() == set()
        for start in (1 + n, 1 + 2 * n):
            assert all(torch.equal(t[1 : 1 + n], t[start : start + n]) for t in kv.values()), "loaded KV differs"
        for t in kv.values():
            t[1 + n :].zero_()
        if not args.first_touch:  # else the next round's values land in pages of the segment never written
            client.remove_all(True)
    worker.shutdown()
    return {"blocks": n, "value_bytes": value_bytes, "times": times}


def _hash_each(values: list[memoryview]) -> None:
    """XXH3-128 over each value: the pass an unkeyed integrity tag takes, with no kvconn code around it."""
    import xxhash

    for value in values:
        xxhash.xxh3_128_digest(value)


def _rotated(items: list[str], by: int) -> list[str]:
    by %= len(items)
    return items[by:] + items[:by]


def _ratio(times: dict[str, list[float]], base: str, label: str) -> float:
    """Median over rounds of ``base``'s time / ``label``'s time in the same round."""
    return statistics.median(b / t for b, t in zip(times[base], times[label], strict=True))


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    n, value, times = result["blocks"], result["value_bytes"], result["times"]
    lines = [
        f"{n} blocks x {value >> 10} KiB ({args.layers} layers x 16 tokens x 8 heads x 128 fp16, K+V) "
        f"= {n * value / 2**20:.0f} MiB per call, median of {args.rounds} rounds",
        "",
        "| operation | GB/s | blocks/s | vs raw batched |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, ts in times.items():
        seconds, op = statistics.median(ts), label.split(":")[0]
        contiguous = _ratio(times, "save: raw batch_put_from" if op == "save" else "load: raw batch_get_into", label)
        lines.append(f"| {label} | {n * value / seconds / 1e9:.2f} | {n / seconds:,.0f} | {contiguous:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--segment-mib", type=int, default=0, help="store size (default: enough for one round)")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="idle milliseconds before each timed call")
    parser.add_argument("--first-touch", action="store_true", help="keep all rounds' values: puts in fresh pages")
    parser.add_argument("--cold", action="store_true", help="warm_segment: false (the segment is not faulted in)")
    parser.add_argument("--json", type=pathlib.Path, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds (a smoke run)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.rounds = 16, 2
    value_mib = args.layers * 64 / 1024
    rounds_kept = args.rounds + 1 if args.first_touch else 1
    args.segment_mib = args.segment_mib or int(args.blocks * value_mib * 4 * 1.3 * rounds_kept) + 64  # the values kept
    if args.inner:
        print("RESULT " + json.dumps(inner(args)))
        return 0
    h = mooncake_netns()
    reason = h.netns_unavailable_reason() or h.mooncake_unavailable_reason(sys.executable)
    if reason:
        print(f"cannot run the Mooncake benchmark here: {reason}", file=sys.stderr)
        return CANNOT_RUN
    argv = [f"--blocks={args.blocks}", f"--layers={args.layers}", f"--rounds={args.rounds}", f"--gap-ms={args.gap_ms}",
            f"--segment-mib={args.segment_mib}", *["--first-touch"] * args.first_touch,
            *["--cold"] * args.cold, "--inner"]  # fmt: skip
    with h.netns() as ns, h.mooncake_master(ns, lease_ttl_ms=5000) as m:
        run = h.run_python(ns, script=__file__, args=argv, env=m.client_env(), timeout=600, python=sys.executable)
    if not run.ok:
        print(run.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    print(
        f"machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, mooncake {_version()}; protocol tcp inside one network namespace"
    )
    print(report(result, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args), **result}, indent=2, default=str))
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("mooncake-transfer-engine-non-cuda")


if __name__ == "__main__":
    sys.exit(main())
