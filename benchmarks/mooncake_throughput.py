"""Mooncake connector throughput against raw Mooncake calls on the same store.

Starts a real ``mooncake_master`` inside a throw-away network namespace (root,
iproute2 and the ``store`` extra needed; see plugins/mooncake/tests/MOONCAKE_NOTES.md)
and re-runs itself inside it. Per round it moves the same bytes four ways:

* plugin save / load: the ``mooncake`` connector's worker side (``wait_for_save``:
  existence check + one multi-buffer put straight from the KV caches;
  ``start_load_kv``: one multi-buffer get straight into them);
* raw batched: one ``batch_put_from`` / ``batch_get_into`` of contiguous values
  (the target: the plugin at >= 0.9 of these), and the same multi-buffer calls the
  plugin makes, issued directly (the plugin's own overhead);
* per block: one ``put_from`` / ``get_into`` call per block.

Prints a Markdown table (median of the rounds) with each figure's ratio to the
raw batched call. Usage: ``python benchmarks/mooncake_throughput.py [--blocks N]
[--layers L] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _harness() -> Any:
    spec = importlib.util.spec_from_file_location("mooncake_netns", ROOT / "plugins/mooncake/tests/mooncake_netns.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["mooncake_netns"] = module
    spec.loader.exec_module(module)
    return module


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def inner(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvconn import ConnectorContext, KVCacheGroupSpec, load_connector
    from kvconn_mooncake import BlockTransfer, MooncakeMetadata

    n, layers, bs, heads, dim = args.blocks, args.layers, 16, 8, 128
    names = tuple(f"layer.{i}" for i in range(layers))
    context = ConnectorContext(block_size=bs, kv_cache_groups=(KVCacheGroupSpec(names),))
    config = {
        "master_server_address": os.environ["MC_MASTER_ADDR"],
        "metadata_server": os.environ["MC_METADATA_URL"],
        "local_hostname": os.environ["MC_LOCAL_HOSTNAME"],
        "global_segment_size": args.segment_mib << 20,
        "local_buffer_size": 64 << 20,
    }
    worker = load_connector("mooncake", role="worker", config=config, context=context)
    kv = {name: torch.randn((2 * n + 1, 2, bs, heads, dim)).half() for name in names}
    worker.register_kv_caches(kv)
    client = worker.worker_side.store._client  # the raw client the plugin uses
    value_bytes = layers * kv[names[0]][0].numel() * 2
    staging = torch.randint(0, 255, (n, value_bytes), dtype=torch.uint8)
    client.register_buffer(staging.data_ptr(), staging.numel())
    ptrs, sizes = [staging[i].data_ptr() for i in range(n)], [value_bytes] * n
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        plugin_keys = [f"plugin-{r}-{i}" for i in range(n)]
        saves = MooncakeMetadata(saves=[BlockTransfer(k, 1 + i, 0) for i, k in enumerate(plugin_keys)])
        loads = MooncakeMetadata(loads=[BlockTransfer(k, 1 + n + i, 0) for i, k in enumerate(plugin_keys)])
        raw, single = [f"raw-{r}-{i}" for i in range(n)], [f"one-{r}-{i}" for i in range(n)]
        multi = [f"multi-{r}-{i}" for i in range(n)]
        multi_ptrs, multi_sizes = worker.worker_side._parts(saves.saves)  # the plugin's own part lists

        def plugin_save(meta: MooncakeMetadata = saves) -> None:
            worker.start_load_kv(meta)
            worker.wait_for_save()
            worker.get_finished(set())

        runs: dict[str, Callable[[], Any]] = {
            "save: plugin": plugin_save,
            "save: raw batch_put_from": lambda raw=raw: client.batch_put_from(raw, ptrs, sizes),
            "save: put_from per block": lambda single=single: [
                client.put_from(k, p, value_bytes) for k, p in zip(single, ptrs, strict=True)
            ],
            "save: raw batch_put_from_multi_buffers": lambda multi=multi, p=multi_ptrs, s=multi_sizes: (
                client.batch_put_from_multi_buffers(multi, p, s)
            ),
            "load: plugin": lambda meta=loads: worker.start_load_kv(meta),
            "load: raw batch_get_into": lambda raw=raw: client.batch_get_into(raw, ptrs, sizes),
            "load: raw batch_get_into_multi_buffers": lambda multi=multi, p=multi_ptrs, s=multi_sizes: (
                client.batch_get_into_multi_buffers(multi, p, s)
            ),
            "load: get_into per block": lambda single=single: [
                client.get_into(k, p, value_bytes) for k, p in zip(single, ptrs, strict=True)
            ],
        }
        for label, fn in runs.items():
            times.setdefault(label, []).append(_timed(fn))
        stats = worker.get_kv_connector_stats()
        assert stats.get("blocks_saved") == n and stats.get("blocks_loaded") == n, stats
        assert worker.get_block_ids_with_load_errors() == set()
        block = names[0]
        assert torch.equal(kv[block][1 : 1 + n], kv[block][1 + n : 1 + 2 * n]), "loaded KV differs"
        for t in kv.values():
            t[1 + n :].zero_()
    worker.shutdown()
    return {"blocks": n, "value_bytes": value_bytes, "times": times}


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    n, value = result["blocks"], result["value_bytes"]
    medians = {label: statistics.median(ts) for label, ts in result["times"].items()}
    lines = [
        f"{n} blocks x {value >> 10} KiB ({args.layers} layers x 16 tokens x 8 heads x 128 fp16, K+V) "
        f"= {n * value / 2**20:.0f} MiB per call, median of {args.rounds} rounds",
        "",
        "| operation | GB/s | blocks/s | vs raw batched |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, seconds in medians.items():
        base = medians["save: raw batch_put_from" if label.startswith("save") else "load: raw batch_get_into"]
        lines.append(f"| {label} | {n * value / seconds / 1e9:.2f} | {n / seconds:,.0f} | {base / seconds:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--segment-mib", type=int, default=0, help="store size (default: enough for every round)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    value_mib = args.layers * 64 / 1024
    args.segment_mib = args.segment_mib or int(args.blocks * value_mib * 4 * args.rounds * 1.3) + 64
    if args.inner:
        print("RESULT " + json.dumps(inner(args)))
        return 0
    h = _harness()
    reason = h.netns_unavailable_reason() or h.mooncake_unavailable_reason(sys.executable)
    if reason:
        print(f"cannot run the Mooncake benchmark here: {reason}", file=sys.stderr)
        return 2
    argv = [f"--blocks={args.blocks}", f"--layers={args.layers}", f"--rounds={args.rounds}", "--inner"]
    argv.append(f"--segment-mib={args.segment_mib}")
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
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("mooncake-transfer-engine-non-cuda")


if __name__ == "__main__":
    sys.exit(main())
