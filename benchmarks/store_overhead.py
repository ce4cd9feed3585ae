"""What the store layer (kvconn.store) costs over the store it drives, measured side by side.

Two comparisons, each interleaved round by round in one process:

* **Redis**: a real ``redis-server`` (127.0.0.1, a free port; the Debian
  package) and the ``redis`` connector's worker side saving and loading N blocks
  of L layers (gather, seal, one pipelined ``SET NX``; one ``MGET``, verify,
  scatter into the KV caches) against the raw pipelined ``SET`` / one ``MGET``
  of the same values on the same client. Fresh keys every round; the store is
  flushed after each. Target: load and save >= 0.7 of raw.
* **In-memory store on the reference engine**: the store connector over
  :class:`kvconn.testing.memory_store.MemoryStore` against today's
  ``MemoryConnector``, the same workload through ``Engine.generate`` (sync
  loads, no local prefix cache, so every hit is a connector load); the
  connector overhead is the time spent inside the connector host's calls (a
  host monitor, as ``kvconn simulate`` measures it). Target: within 1.2x of the
  memory connector's.

Usage: ``python benchmarks/store_overhead.py [--blocks N] [--layers L] [--rounds R] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import random
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib import Bench

ROOT = Path(__file__).resolve().parents[1]
CANNOT_RUN = 2


def _redis_server() -> Any:
    spec = importlib.util.spec_from_file_location("redis_server", ROOT / "plugins/redis/tests/redis_server.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RedisServer()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def redis_rows(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per row, its seconds in each measured round (rounds are paired: one of each row per round)."""
    import torch

    from kvconn import ConnectorContext, KVCacheGroupSpec, KVConnectorRole
    from kvconn.store import StoreBlock, StoreMetadata
    from kvconn_redis import RedisConnector

    layers = tuple(f"layer.{i}" for i in range(args.layers))
    context = ConnectorContext(block_size=16, kv_cache_groups=(KVCacheGroupSpec(layers),))
    server = _redis_server().start()
    try:
        config = RedisConnector.Config(url=server.url, load_async=False, timeout_s=30.0, socket_timeout_s=30.0)
        worker: Any = RedisConnector(config, role=KVConnectorRole.WORKER, context=context).side
        blocks = 2 * args.blocks + 1
        caches = {name: torch.randn(blocks, 2, 16, args.kv_heads, args.head_dim).half() for name in layers}
        worker.register_kv_caches(caches)
        client = server.client()
        rows: dict[str, list[float]] = {"store save": [], "raw SET": [], "store load": [], "raw MGET": []}
        for round_ in range(args.rounds + 1):  # round 0 warms up (opens the connection, starts the threads)
            hashes = [uuid.uuid4().bytes * 2 for _ in range(args.blocks)]
            saves = [StoreBlock("r", 0, 1 + i, h) for i, h in enumerate(hashes)]
            loads = [StoreBlock("r", 0, 1 + args.blocks + i, h) for i, h in enumerate(hashes)]

            def save(saves: list[StoreBlock] = saves) -> None:
                worker.start_load_kv(StoreMetadata(saves=saves, load_async=False))
                worker.wait_for_save()
                worker.get_finished(set())

            def load(loads: list[StoreBlock] = loads) -> None:
                worker.start_load_kv(StoreMetadata(loads=loads, load_async=False))
                worker.get_finished(set())

            rows["store save"].append(_timed(save))
            keys = [worker.keys.key(0, h) for h in hashes]
            values = client.mget(keys)  # the very bytes the store layer wrote
            raw_keys = [b"raw/" + k for k in keys]

            def raw_set(raw_keys: list[bytes] = raw_keys, values: list[Any] = values) -> None:
                pipe = client.pipeline(transaction=False)
                for k, v in zip(raw_keys, values, strict=True):
                    pipe.set(k, v)
                pipe.execute()

            rows["raw SET"].append(_timed(raw_set))
            rows["store load"].append(_timed(load))
            rows["raw MGET"].append(_timed(lambda raw_keys=raw_keys: client.mget(raw_keys)))
            assert worker.get_block_ids_with_load_errors() == set()
            for name, t in caches.items():
                assert torch.equal(t[1 : 1 + args.blocks], t[1 + args.blocks :]), f"{name}: load not bit-exact"
            client.flushall()
            if round_ == 0:
                for times in rows.values():
                    times.clear()
        worker.shutdown()
    finally:
        server.stop()
    return rows


def engine_rows(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per connector, its seconds inside the engine's connector-host calls in each measured round (paired)."""
    from kvconn.reference import Engine
    from kvconn.testing import memory_connector, memory_store

    rng = random.Random(1)
    shared = [rng.randrange(32_000) for _ in range(args.prompt_tokens)]
    prompts = [shared + [rng.randrange(32_000) for _ in range(20 + i)] for i in range(args.prompts)]
    connectors: dict[str, tuple[str, dict[str, Any]]] = {
        "memory connector": (f"{memory_connector.__name__}:MemoryConnector", {}),
        "store connector": (f"{memory_store.__name__}:MemoryStoreConnector", {"load_async": False}),
    }
    times: dict[str, list[float]] = {name: [] for name in connectors}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (connector, config) in connectors.items():
            memory_connector.STORE.clear()
            memory_store.clear()
            gc.collect()  # a full collection left over from the last run would land in this one's hooks
            inside = [0.0, 0.0]  # total, start of the call in progress (host calls never nest)

            def before(call: str, call_args: tuple[Any, ...], inside: list[float] = inside) -> None:
                inside[1] = time.perf_counter()

            def after(call: str, call_args: tuple[Any, ...], outcome: Any, inside: list[float] = inside) -> None:
                inside[0] += time.perf_counter() - inside[1]

            with Engine(connector, config, num_blocks=256, enable_prefix_caching=False) as engine:
                for host in (engine.scheduler_host, engine.worker_host):
                    if host is not None:
                        host.add_monitor(before, after)
                for p in prompts:
                    engine.generate([p], max_tokens=4)
            if round_:
                times[name].append(inside[0])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks per batched save and load (Redis)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=12, help="requests per reference-engine run")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="shared prefix of the reference workload")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a smoke run)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.layers, args.prompts, args.prompt_tokens, args.rounds = 8, 2, 3, 64, 2
    if shutil.which("redis-server") is None:
        print("cannot run: redis-server is not installed (make install)", file=sys.stderr)
        return CANNOT_RUN
    redis = redis_rows(args)
    engine = engine_rows(args)
    value_mib = args.blocks * args.layers * 2 * 16 * args.kv_heads * args.head_dim * 2 / (1 << 20)
    table = Bench(
        f"store layer overhead: Redis {args.blocks} blocks x {args.layers} layers ({value_mib:.1f} MiB per batch); "
        f"reference engine {args.prompts} requests sharing {args.prompt_tokens} tokens; {args.rounds} rounds",
        ["what", "median s", "ratio"],
    )

    def paired(raw: str, store: str) -> float:
        return statistics.median(r / s for r, s in zip(redis[raw], redis[store], strict=True))

    save_ratio, load_ratio = paired("raw SET", "store save"), paired("raw MGET", "store load")
    for name in ("store save", "raw SET", "store load", "raw MGET"):
        ratio = save_ratio if name == "store save" else load_ratio if name == "store load" else 1.0
        table.row(f"redis {name}", statistics.median(redis[name]), ratio)
    engine_ratio = statistics.median(
        s / m for s, m in zip(engine["store connector"], engine["memory connector"], strict=True)
    )
    medians = {name: statistics.median(t) for name, t in engine.items()}
    for name, t in medians.items():
        table.row(f"engine {name} (time in hooks)", t, engine_ratio if name == "store connector" else 1.0)
    table.target("Redis save >= 0.7 of raw pipelined SET", save_ratio >= 0.7, f"{save_ratio:.3f}")
    table.target("Redis load >= 0.7 of raw MGET", load_ratio >= 0.7, f"{load_ratio:.3f}")
    table.target(
        "store connector overhead (in-memory store) within 1.2x of the memory connector's",
        engine_ratio <= 1.2,
        f"{engine_ratio:.3f} ({medians['store connector']:.4f} s vs {medians['memory connector']:.4f} s in hooks)",
    )
    table.notes.append(
        "ratio: the median over rounds of the ratio in the same round (Redis: raw time / store-layer time; "
        "engine: store / memory connector time in hooks)"
    )
    return table.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
