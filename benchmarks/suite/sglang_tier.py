"""What the kvconn SGLang tier costs over the store it drives: pages through the adapter against raw batched calls.

SGLang's own ``MHATokenToKVPoolHost`` (``page_first``, on the CPU) holds the
pages; the adapter (``kvconn_sglang.KVConnStorage``, built by SGLang's
``StorageBackendFactory``) saves them with ``batch_set_v1`` (seal, one batched
put of each page's header and its K and V read in place) and loads them with
``batch_get_v1`` (one batched get into staging, verify, copy into the pool's
pages); the raw side calls the same store's batched ``put`` / ``get`` on the
same pages' bytes (no header, no verification, no copy into the pool). Per
round: fresh keys, raw and adapter alternating which goes first. Stores: a real
``redis-server`` (127.0.0.1, a free port) and Mooncake's embedded store.
Target: adapter throughput >= 0.9 of raw, each store and direction (the median
of the per-round ratios). On a shared machine a round of a few milliseconds is
often cut by another process's time slice, so the ratio of each side's fastest
round is shown beside it ("best": the cost of the work itself, undisturbed).

Needs SGLang (``.venv-sglang``): ``kvconn bench sglang`` from that venv.
Usage: ``python benchmarks/suite/sglang_tier.py [--pages N] [--rounds R] [--breakdown] [--quick] [--json FILE]``.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchlib import CANNOT_RUN, Bench, arg_parser, redis_server

TARGET = 0.9


def _pools(page_size: int, layers: int, heads: int, head_dim: int, pages: int) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = 5 * pages * page_size  # two stores' save and load slots, and the breakdown's
    device = MHATokenToKVPool(
        tokens, page_size, torch.float16, head_num=heads, head_dim=head_dim, layer_num=layers, device="cpu",
        enable_memory_saver=False, start_layer=0, end_layer=layers - 1,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 1.0, 0, page_size, "page_first", pin_memory=False,
        device_capacity_tokens=device.size, start_layer=0, end_layer=layers - 1,
    )  # fmt: skip
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).half())
    return host


def _joined(parts: list[memoryview]) -> memoryview:
    """A writable copy of ``parts`` end to end (a put takes it as it is), freeing no page-sized temporary.

    A freed temporary (``b"".join``) is memory the next put's values would reuse, with no page faults: the raw
    side's first put would then take half the time of every later one, and of the tier's.
    """
    copy = memoryview(bytearray(sum(part.nbytes for part in parts)))
    at = 0
    for part in parts:
        copy[at : at + part.nbytes] = part
        at += part.nbytes
    return copy


def _measure(store: str, config: dict[str, Any], raw_store: Any, host: Any, pages: int, rounds: int) -> dict[str, list]:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconn_sglang import extra_config
    from kvconn_sglang.testing.rig import storage_config

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(store, config)), host)
    backend.register_mem_pool_host(host)
    page_size = host.page_size
    saved = host.alloc(pages * page_size)
    target = host.alloc(pages * page_size)
    views = backend.tier.views
    page_bytes = [_joined(parts) for parts in views.pages(saved)]
    buffers = [memoryview(bytearray(len(b))) for b in page_bytes]
    ratios: dict[str, list] = {"save": [], "load": [], "raw_save_s": [], "kvconn_save_s": [], "raw_load_s": [],
                               "kvconn_load_s": []}  # fmt: skip
    for r in range(rounds + 1):  # round 0 warms both sides up
        hashes = [f"{uuid.uuid4().hex}{i:032x}" for i in range(pages)]
        raw_keys = [f"raw/{h}".encode() for h in hashes]

        def raw_save(keys: list[bytes] = raw_keys) -> None:
            assert all(raw_store.put(keys, page_bytes))

        def kvconn_save(names: list[str] = hashes) -> None:
            assert all(backend.batch_set_v1(names, saved))

        def raw_load(keys: list[bytes] = raw_keys) -> None:
            assert all(n is not None for n in raw_store.get(keys, buffers))

        def kvconn_load(names: list[str] = hashes) -> None:
            assert all(backend.batch_get_v1(names, target))

        times = {}
        pairs = [("raw_save_s", raw_save), ("kvconn_save_s", kvconn_save)]
        for name, fn in pairs if r % 2 else pairs[::-1]:
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        pairs = [("raw_load_s", raw_load), ("kvconn_load_s", kvconn_load)]
        for name, fn in pairs if r % 2 else pairs[::-1]:
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        if r == 0:
            continue
        for name, seconds in times.items():
            ratios[name].append(seconds)
        ratios["save"].append(times["raw_save_s"] / times["kvconn_save_s"])
        ratios["load"].append(times["raw_load_s"] / times["kvconn_load_s"])
    backend.close()
    return ratios


def _fastest_ms(pieces: dict[str, Callable[[int], object]], calls: int) -> dict[str, float]:
    """Each piece's fastest of ``calls - 1`` calls (``fn(i)`` for the i-th), in milliseconds, the pieces in turn.

    The first call of each warms up, untimed: a put allocates the values it stores, and the first puts take
    memory freed before them (half the time of a fresh put), which only the piece timed first would get.
    """
    best = dict.fromkeys(pieces, float("inf"))
    for i in range(calls):
        for name, fn in pieces.items():
            start = time.perf_counter()
            fn(i)
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    return {name: 1000 * seconds for name, seconds in best.items()}


def _xxh3(parts: list[memoryview]) -> bytes:
    """XXH3-128 over ``parts`` in order, nothing else: what the integrity tag costs without its Python."""
    import xxhash

    mac = xxhash.xxh3_128()
    for part in parts:
        mac.update(part)
    return mac.digest()


def _breakdown(host: Any, pages: int, calls: int = 50) -> str:
    """Where an embedded-store save and load of ``pages`` pages spend their time: each piece alone, fastest call."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvconn.store import HEADER_BYTES
    from kvconn.store.values import judge, seal_parts
    from kvconn_sglang import extra_config
    from kvconn_sglang.testing.rig import storage_config

    config = {"embedded_store": f"bench-{uuid.uuid4().hex}", "embedded_capacity_bytes": 8 << 30}
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config("mooncake", config)), host)
    backend.register_mem_pool_host(host)
    tier, n = backend.tier, pages * host.page_size
    store, slots = tier.guard.call("open", lambda opened: opened), host.alloc(n)
    views = tier.views.pages(slots)
    names = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(2 * calls)]
    keys = [tier.key(h) for h in names[0]]
    flat = [_joined(p) for p in views]
    sealed = seal_parts(tier.integrity, keys, tier.views.digest, views)
    fresh = [[uuid.uuid4().bytes for _ in range(pages)] for _ in range(2 * calls)]
    pieces = _fastest_ms(
        {
            "raw put": lambda i: store.put(fresh[i], flat),
            "seal (tag pass)": lambda _: seal_parts(tier.integrity, keys, tier.views.digest, views),
            "put_parts": lambda i: store.put_parts(fresh[calls + i], sealed),
            "batch_set_v1": lambda i: backend.batch_set_v1(names[i], slots),
        },
        calls,
    )
    backend.batch_set_v1(names[0], slots)
    buffers = [memoryview(bytearray(HEADER_BYTES + len(f))) for f in flat]
    headers = memoryview(bytearray(pages * HEADER_BYTES))
    parts = [[headers[i * HEADER_BYTES : (i + 1) * HEADER_BYTES], *v] for i, v in enumerate(views)]
    lengths = store.get_parts(keys, parts)
    pieces |= _fastest_ms(
        {
            "raw get": lambda _: store.get(keys, buffers),
            "page views": lambda _: tier.views.pages(slots),
            "get_parts (in place)": lambda _: store.get_parts(keys, parts),
            "verify (tag pass)": lambda _: [
                judge(tier.integrity, k, tier.views.digest, n, p[0], p[1:])
                for k, n, p in zip(keys, lengths, parts, strict=True)
            ],
            "XXH3 alone": lambda _: [_xxh3(p) for p in parts],  # the tag pass's floor: no header checks
            "batch_get_v1": lambda _: backend.batch_get_v1(names[0], slots),
        },
        calls,
    )
    backend.close()
    return f"embedded store, fastest of {calls - 1} calls, ms: " + ", ".join(f"{k} {v:.2f}" for k, v in pieces.items())


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--pages", type=int, default=64, help="pages per batched call (SGLang batches up to 128)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--breakdown", action="store_true", help="also time each piece of an embedded save and load")
    args = parser.parse_args()
    try:
        import sglang  # noqa: F401
    except ImportError:
        print(
            "cannot run here: needs SGLang (run it from .venv-sglang, which make test-sglang builds)", file=sys.stderr
        )
        return CANNOT_RUN
    from kvconn_sglang.testing.rig import init_sglang

    init_sglang()
    pages, rounds = (4, 2) if args.quick else (args.pages, args.rounds)
    shape = (16, 8, 4, 64)  # page size, layers, KV heads, head dim: 128 KiB a page in fp16
    host = _pools(*shape, pages=pages)
    bench = Bench("kvconn SGLang tier against the store's raw batched calls",
                  ["store", "pages", "page KiB", "raw save ms", "kvconn save ms", "save ratio", "raw load ms",
                   "kvconn load ms", "load ratio", "best save ratio", "best load ratio"])  # fmt: skip
    runs: dict[str, tuple[dict[str, Any], Any, Any]] = {}
    from kvconn_mooncake.config import MooncakeConfig
    from kvconn_mooncake.connector import open_store

    name = f"bench-{uuid.uuid4().hex}"
    mooncake = {"embedded_store": name, "embedded_capacity_bytes": 8 << 30}
    runs["mooncake (embedded)"] = ("mooncake", mooncake), open_store(MooncakeConfig(**mooncake)), None
    server = None
    try:
        server = redis_server().start()
        import redis

        from kvconn_redis import RedisStore

        config = {"url": server.url, "timeout_s": 30.0, "socket_timeout_s": 30.0}
        runs["redis"] = ("redis", config), RedisStore(redis.Redis.from_url(server.url, socket_timeout=30.0)), server
    except RuntimeError as exc:  # no redis-server here
        bench.notes.append(f"redis left out: {exc}")
    try:
        for label, ((store, config), raw_store, srv) in runs.items():
            figures = _measure(store, config, raw_store, host, pages, rounds)
            med = {k: statistics.median(v) for k, v in figures.items()}
            bench.row(label, pages, host.page_size * shape[1] * shape[2] * shape[3] * 2 * 2 // 1024,
                      1000 * med["raw_save_s"], 1000 * med["kvconn_save_s"], med["save"],
                      1000 * med["raw_load_s"], 1000 * med["kvconn_load_s"], med["load"],
                      min(figures["raw_save_s"]) / min(figures["kvconn_save_s"]),
                      min(figures["raw_load_s"]) / min(figures["kvconn_load_s"]))  # fmt: skip
            for direction in ("save", "load"):
                bench.target(f"{label} {direction} >= {TARGET} of raw", med[direction] >= TARGET,
                             f"{med[direction]:.2f} (median of {rounds} rounds)")  # fmt: skip
            if srv is not None:
                raw_store.client.flushall()
    finally:
        if server is not None:
            server.stop()
    if args.breakdown:
        bench.notes.append(_breakdown(host, pages))
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
