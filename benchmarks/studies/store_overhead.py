"""What the store layer (kvconn.store) costs over the store it drives, measured side by side.

Two comparisons, each interleaved round by round in one process:

* **Redis**: a real ``redis-server`` (127.0.0.1, a free port; the Debian
  package) and the ``redis`` connector's worker side saving and loading N blocks
  of L layers (seal, one pipelined ``SET NX`` of each value's header and its
  rows read in place from the KV caches; one ``MGET``, verify, scatter into
  the KV caches) against the raw pipelined ``SET`` / one ``MGET``
  of the same values on the same client. Fresh keys every round; the store is
  flushed after each. Target: load and save >= 0.7 of raw.
* **In-memory store on the reference engine**: store connectors over
  :class:`kvconn.testing.memory_store.MemoryStore` against the raw-hook memory
  connector (``kvconn.testing.hook_reference``, what ``MemoryConnector`` was
  before it became a store connector), the same workload through
  ``Engine.generate`` (sync loads, no local prefix cache, so every hit is a
  connector load): ``MemoryConnector``, which declares its store in-process
  (calls inline, saves in place), and ``MemoryStoreConnector``, whose calls go
  to the store thread under a deadline as a server's do. The connector
  overhead is the time spent inside the connector host's calls (a host
  monitor, as ``kvconn simulate`` measures it), wall clock and this process's
  CPU time (which a loaded machine's preemptions do not inflate). Target: the
  in-process store connector within 1.2x of the raw-hook connector's.

Usage: ``python benchmarks/studies/store_overhead.py [--blocks N] [--layers L] [--rounds R] [--engine-rounds R]
[--engine-only] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchlib import CANNOT_RUN, Bench, arg_parser, redis_server


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
    server = redis_server().start()
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


#: The reference-engine rows: the baseline, the store connector calling its store inline, then through its thread.
HOOKS, INLINE, THREADED = "raw-hook memory connector", "store connector, in-process store", "store connector, thread"


def engine_rows(args: argparse.Namespace) -> dict[str, list[float]]:
    """Per connector (and ``<name> cpu``), its seconds inside the connector-host calls in each round (paired)."""
    from kvconn.reference import Engine
    from kvconn.testing import hook_reference, memory_connector, memory_store

    rng = random.Random(1)
    shared = [rng.randrange(32_000) for _ in range(args.prompt_tokens)]
    prompts = [shared + [rng.randrange(32_000) for _ in range(20 + i)] for i in range(args.prompts)]
    connectors: dict[str, tuple[str, dict[str, Any]]] = {
        HOOKS: (f"{hook_reference.__name__}:HookReferenceConnector", {}),
        INLINE: (f"{memory_connector.__name__}:MemoryConnector", {}),
        THREADED: (f"{memory_store.__name__}:MemoryStoreConnector", {"load_async": False}),
    }
    times: dict[str, list[float]] = {key: [] for name in connectors for key in (name, f"{name} cpu")}
    order = list(connectors)
    for round_ in range(args.engine_rounds + 1):  # round 0 warms up
        for name in order[round_ % len(order) :] + order[: round_ % len(order)]:  # each first in turn
            connector, config = connectors[name]
            hook_reference.STORE.clear()
            memory_store.clear()
            gc.collect()  # a full collection left over from the last run would land in this one's hooks
            inside = [0.0, 0.0, 0.0, 0.0]  # wall and CPU: totals, then the start of the call in progress

            def before(call: str, call_args: tuple[Any, ...], inside: list[float] = inside) -> None:
                inside[2], inside[3] = time.perf_counter(), time.process_time()  # host calls never nest

            def after(call: str, call_args: tuple[Any, ...], outcome: Any, inside: list[float] = inside) -> None:
                inside[0] += time.perf_counter() - inside[2]
                inside[1] += time.process_time() - inside[3]

            with Engine(connector, config, num_blocks=256, enable_prefix_caching=False) as engine:
                for host in (engine.scheduler_host, engine.worker_host):
                    if host is not None:
                        host.add_monitor(before, after)
                for p in prompts:
                    engine.generate([p], max_tokens=4)
            if round_:
                times[name].append(inside[0])
                times[f"{name} cpu"].append(inside[1])
    return times


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per batched save and load (Redis)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=12, help="requests per reference-engine run")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="shared prefix of the reference workload")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of the Redis rows")
    parser.add_argument("--engine-rounds", type=int, default=25, help="rounds of the reference-engine rows")
    parser.add_argument("--engine-only", action="store_true", help="only the reference-engine rows (no Redis)")
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.layers, args.prompts, args.prompt_tokens, args.rounds, args.engine_rounds = 8, 2, 3, 64, 2, 2
    if not args.engine_only and shutil.which("redis-server") is None:
        print("cannot run: redis-server is not installed (make install)", file=sys.stderr)
        return CANNOT_RUN
    redis = {} if args.engine_only else redis_rows(args)
    engine = engine_rows(args)
    value_mib = args.blocks * args.layers * 2 * 16 * args.kv_heads * args.head_dim * 2 / (1 << 20)
    table = Bench(
        f"store layer overhead: Redis {args.blocks} blocks x {args.layers} layers ({value_mib:.1f} MiB per batch); "
        f"reference engine {args.prompts} requests sharing {args.prompt_tokens} tokens; {args.rounds} and "
        f"{args.engine_rounds} rounds",
        ["what", "median s", "ratio"],
    )

    def paired(rows: dict[str, list[float]], numerator: str, denominator: str) -> float:
        return statistics.median(n / d for n, d in zip(rows[numerator], rows[denominator], strict=True))

    if redis:
        save_ratio, load_ratio = paired(redis, "raw SET", "store save"), paired(redis, "raw MGET", "store load")
        for name in ("store save", "raw SET", "store load", "raw MGET"):
            ratio = save_ratio if name == "store save" else load_ratio if name == "store load" else 1.0
            table.row(f"redis {name}", statistics.median(redis[name]), ratio)
        table.target("Redis save >= 0.7 of raw pipelined SET", save_ratio >= 0.7, f"{save_ratio:.3f}")
        table.target("Redis load >= 0.7 of raw MGET", load_ratio >= 0.7, f"{load_ratio:.3f}")
    ratios = {name: paired(engine, name, HOOKS if " cpu" not in name else f"{HOOKS} cpu") for name in engine}
    for name, times in engine.items():
        what = "CPU" if name.endswith(" cpu") else "time"
        table.row(f"engine {name.removesuffix(' cpu')} ({what} in hooks)", statistics.median(times), ratios[name])
    table.target(
        "store connector overhead (in-process store) within 1.2x of the raw-hook memory connector's",
        ratios[INLINE] <= 1.2,
        f"{ratios[INLINE]:.3f} ({statistics.median(engine[INLINE]):.4f} s vs {statistics.median(engine[HOOKS]):.4f} s "
        f"in hooks; CPU {ratios[f'{INLINE} cpu']:.3f}; through the store thread {ratios[THREADED]:.3f})",
    )
    table.notes.append(
        "ratio: the median over rounds of the ratio in the same round (Redis: raw time / store-layer time; "
        "engine: connector / raw-hook memory connector, time or CPU in hooks)"
    )
    return table.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
