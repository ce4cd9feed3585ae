"""Behavioural scenarios of the mooncake connector, shared by both backends.

Each scenario drives the reference engine with the connector and returns a
JSON-able dict of what happened; the tests assert on it. The embedded-backend
tests call them in-process. The real-store tests run this file as a script
inside a network namespace (``python scenarios.py NAME [ARGS]``; the master's
address comes from the ``MC_*`` variables the harness sets) and read the JSON
it prints on its last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from kvconn import KVCacheGroupSpec, KVConnectorOutput, StepUpdate
from kvconn.hashing import hash_blocks
from kvconn.reference import Engine
from kvconn.store import HEADER_BYTES, Integrity
from kvconn.telemetry import BlockStored
from kvconn_mooncake import MooncakeConfig, MooncakeConnector, open_store, resolve_backend

Config = dict[str, Any]
BIG_KV = {"num_kv_heads": 8, "head_dim": 128}  # 64 KiB per layer per 16-token block


def real_store_config(**extra: Any) -> Config:
    """Connector config for the master the harness started (``MC_*`` variables)."""
    return {
        "master_server_address": os.environ["MC_MASTER_ADDR"],
        "metadata_server": os.environ["MC_METADATA_URL"],
        "local_hostname": os.environ["MC_LOCAL_HOSTNAME"],
        "protocol": "tcp",
        "global_segment_size": 64 << 20,
        **extra,
    }


def prompts(n: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(32_000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(32_000) for _ in range(suffix_len)] for _ in range(n)]


def connector(engine: Engine, role: str = "worker") -> MooncakeConnector:
    host = engine.worker_host if role == "worker" else engine.scheduler_host
    assert host is not None
    conn = host.connectors["mooncake"]
    assert isinstance(conn, MooncakeConnector)
    return conn


def totals(engine: Engine) -> dict[str, int]:
    """Engine stats plus the connector's cumulative counters (degraded events included), the last put counted."""
    worker = connector(engine).side
    worker.settle_saves()  # save_async (the default): the last step's put may still be running
    scheduler = connector(engine, "scheduler").side
    return {
        **engine.stats.as_dict(),
        **{k: int(v) for k, v in worker.stats.totals.items()},
        **{f"scheduler_{k}": int(v) for k, v in scheduler.stats.totals.items()},
        "tracked": connector(engine, "scheduler").side.get_num_tracked_requests(),
        "held": len(engine.scheduler.held_requests),
        "hook_errors": sum(h.degraded_events for h in (engine.scheduler_host, engine.worker_host) if h),
    }


def kv_by_hash(engine: Engine, requests: Sequence[Sequence[int]]) -> dict[tuple[int, str], list[Any]]:
    """KV of every cached full prompt block, by (group, block hash): what a load must reproduce."""
    pool = engine.scheduler.kv_cache_manager.pool
    found: dict[tuple[int, str], list[Any]] = {}
    for prompt in requests:
        for h in hash_blocks(prompt, engine.context.block_size):
            for g, spec in enumerate(engine.context.kv_cache_groups):
                block = pool.lookup(g, h)
                if block is not None:
                    found[(g, h.hex())] = [
                        engine.worker.kv_caches[name][block.block_id].clone() for name in spec.layer_names
                    ]
    return found


def _equal_kv(a: dict[tuple[int, str], list[Any]], b: dict[tuple[int, str], list[Any]]) -> tuple[int, bool]:
    import torch

    common = a.keys() & b.keys()
    return len(common), all(all(torch.equal(x, y) for x, y in zip(a[k], b[k], strict=True)) for k in common)


# ------------------------------------------------------------------ scenarios


def save_then_load(config: Config, block_size: int = 16, **engine_options: Any) -> dict[str, Any]:
    """Engine 1 computes and saves; a fresh engine 2 on the same store loads the prefixes.

    Engine 1 stays open while engine 2 runs (a real client's data lives in its segment).
    """
    options = {"block_size": block_size, "num_blocks": 256, "max_num_batched_tokens": 4 * block_size, **engine_options}
    work = prompts(4, prefix_len=3 * block_size + block_size // 2, suffix_len=block_size + 3)
    base_engine = Engine(**options)
    baseline = base_engine.generate(work, max_tokens=4)
    with Engine("mooncake", config, **options) as first:
        first_tokens = first.generate(work, max_tokens=4)
        with Engine("mooncake", config, **options) as second:
            second_tokens = second.generate(work, max_tokens=4)
            compared, kv_equal = _equal_kv(kv_by_hash(base_engine, work), kv_by_hash(second, work))
            return {
                "baseline": baseline,
                "first": first_tokens,
                "second": second_tokens,
                "compared_blocks": compared,
                "prompt_blocks": len({h for p in work for h in hash_blocks(p, block_size)}),
                "kv_equal": kv_equal,
                "first_stats": totals(first),
                "second_stats": totals(second),
            }


def fill_steps(config: Config, block_size: int = 16) -> dict[str, Any]:
    """Step one chunked prefill and check, after every step, which blocks are in the store.

    A block must be stored right after the step that fills it; a step that fills
    a block without allocating one (the block-fill step) must save it too.
    """
    chunk = block_size // 2  # every other step fills a block and allocates nothing
    options = {"block_size": block_size, "num_blocks": 64, "max_num_batched_tokens": chunk}
    with Engine("mooncake", config, **options) as engine:
        request = engine.add_request(prompts(1, 4 * block_size, 3)[0], max_tokens=1)
        worker = connector(engine).side
        outputs: list[Any] = []
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]  # type: ignore[method-assign]
        violations, no_alloc_fills, full = [], 0, 0
        while engine.scheduler.has_work():
            engine.step()
            worker.settle_saves()  # save_async (the default): the store as the step left it, once its put landed
            filled, full = full, request.num_computed_tokens // block_size
            keys = [worker.keys.key(0, h) for h in request.block_hashes]
            stored = [int(x) for x in worker.guard.call("contains", lambda store, keys=keys: store.contains(keys))]
            expected = [int(i < full) for i in range(len(request.block_hashes))]
            if stored != expected:
                violations.append({"step": len(outputs), "stored": stored, "expected": expected})
            cached = outputs[-1].scheduled_cached_reqs
            if request.request_id in cached.req_ids and full > filled:
                no_alloc_fills += cached.new_block_ids[cached.req_ids.index(request.request_id)] is None
        return {"violations": violations, "no_alloc_fills": no_alloc_fills, "stats": totals(engine)}


def isolation(config: Config) -> dict[str, Any]:
    """Blocks saved by one engine are hit only by engines whose blocks mean the same.

    ``comma_layers`` has one layer named like the writer's two joined with a
    comma, ``other_shape`` another KV shape: both with the writer's block bytes.
    """
    work = prompts(2, 48, 5, seed=3)
    hits, exact = {}, {}
    # two tensor-parallel ranks, each saving its own shard: "same" hits only if each rank reads its own
    writer_options = {"model": "model-a", "tp_size": 2}
    with Engine("mooncake", config, **writer_options) as writer:
        writer.generate(work, max_tokens=2)
        for name, changed in {
            "same": {},
            "other_model": {"model": "model-b"},
            "other_tp_size": {"tp_size": 1},
            "other_dtype": {"dtype": "bfloat16"},
            "comma_layers": {"kv_cache_groups": (KVCacheGroupSpec(("layer.0,layer.1",)),), "head_dim": 16},
            "other_shape": {"num_kv_heads": 4, "head_dim": 4},
        }.items():
            options = {**writer_options, **changed}
            with Engine("mooncake", config, **options) as reader:
                tokens = reader.generate(work, max_tokens=8)
                hits[name] = reader.stats.prompt_tokens_loaded
                exact[name] = tokens == Engine(**options).generate(work, max_tokens=8)
    return {"loaded_tokens": hits, "exact": exact}


def store_full(config: Config) -> dict[str, Any]:
    """More KV than the store holds: saves that do not fit are skipped and counted; output unchanged."""
    options = {"num_blocks": 400, "max_num_batched_tokens": 4096, **BIG_KV}
    work = prompts(1, 3000, 10, seed=5)  # 187 blocks x 128 KiB: more than a 16 MiB segment
    baseline = Engine(**options).generate(work, max_tokens=2)
    with Engine("mooncake", config, **options) as engine:
        tokens = engine.generate(work, max_tokens=2)
        return {"same_tokens": tokens == baseline, "stats": totals(engine)}


def load_failures(config: Config, **engine_options: Any) -> dict[str, Any]:
    """Engine 2 loads what engine 1 saved; the loads fail (the test arranges how): output unchanged."""
    options = {"num_blocks": 400, "max_num_batched_tokens": 4096, **engine_options}
    work = prompts(1, 1600, 10, seed=6)
    baseline = Engine(**options).generate(work, max_tokens=3)
    with Engine("mooncake", config, **options) as first:
        first.generate(work, max_tokens=3)
        with Engine("mooncake", config, **options) as second:
            tokens = second.generate(work, max_tokens=3)
            return {"same_tokens": tokens == baseline, "first": totals(first), "stats": totals(second)}


def producer(config: Config, wait_file: str) -> None:
    """Two-node producer: prefill, save, print the tokens, stay alive until ``wait_file`` exists."""
    with Engine("mooncake", config) as engine:
        tokens = engine.generate(prompts(3, 80, 7, seed=9), max_tokens=6)
        print(json.dumps({"tokens": tokens, "stats": totals(engine)}), flush=True)
        _wait_for(wait_file, 120)


def consumer(config: Config) -> dict[str, Any]:
    with Engine("mooncake", config) as engine:
        tokens = engine.generate(prompts(3, 80, 7, seed=9), max_tokens=6)
        return {"tokens": tokens, "stats": totals(engine)}


def master_fault(config: Config, workdir: str) -> None:
    """Save, then keep stepping while the test kills the master, then again after it restarts.

    Protocol with the test: prints ``MID`` and waits for ``workdir/killed``;
    prints ``DOWN {json}`` and waits for ``workdir/restarted``; prints ``UP {json}``.
    """
    work = prompts(3, 64, 6, seed=11)
    baseline = Engine().generate(work, max_tokens=4)
    with Engine("mooncake", config) as engine:
        requests = [engine.add_request(p, max_tokens=4) for p in work]
        for _ in range(3):
            engine.step()
        print("MID", flush=True)
        _wait_for(os.path.join(workdir, "killed"), 60)
        times = timed_steps(engine)
        engine.run_until_done()
        with Engine("mooncake", config) as fresh:  # no local cache: every prefix is a store lookup
            seen = reported(fresh)
            fresh_tokens = fresh.generate(work, max_tokens=4)
            # save_async: a put's failure is counted when it returns, and reported by the step after that; on busy
            # cores the last put may return after the workload's last step, so one more step reports it
            connector(fresh).side.settle_saves()
            fresh.step()
            print("DOWN " + json.dumps({
                "same_tokens": [list(r.output_token_ids) for r in requests] == baseline == fresh_tokens,
                "first": totals(engine), "fresh": totals(fresh), "max_step_s": max(times), "reported": seen,
            }), flush=True)  # fmt: skip
        _wait_for(os.path.join(workdir, "restarted"), 60)
        _wait_until_saving(engine, config, 30)  # the client reconnects by itself, then probes clear the trips
        later = prompts(2, 64, 6, seed=12)
        later_tokens = engine.generate(later, max_tokens=4)
        with Engine("mooncake", config) as reader:
            reread = reader.generate(later, max_tokens=4)
            print("UP " + json.dumps({
                "same_tokens": later_tokens == reread == Engine().generate(later, max_tokens=4),
                "writer": totals(engine), "reader": totals(reader),
            }), flush=True)  # fmt: skip


def timed_steps(engine: Engine) -> list[float]:
    """Seconds of every step ``engine`` runs from now on (reported as figures; no test asserts on time)."""
    times: list[float] = []
    step = engine.step

    def timed() -> None:
        start = time.monotonic()
        step()
        times.append(round(time.monotonic() - start, 3))

    engine.step = timed  # type: ignore[method-assign]
    return times


def reported(engine: Engine) -> Counter[str]:
    """The worker side's stats as the scheduler side receives them, summed over the steps from now on."""
    seen: Counter[str] = Counter()
    host = engine.scheduler_host
    assert host is not None
    update = host.update_connector_output

    def spy(outputs: Mapping[str, KVConnectorOutput]) -> StepUpdate:
        seen.update(outputs["mooncake"].stats if "mooncake" in outputs else {})
        return update(outputs)

    host.update_connector_output = spy  # type: ignore[method-assign]
    return seen


def connect_deadline(config: Config, master: str) -> dict[str, Any]:
    """An engine whose master is not one (a TCP sink, a paused master): built within ``setup_timeout_s``.

    The second ``generate`` runs after ``retry_interval_s``, so a reconnect is
    attempted meanwhile; it must not stall a step either.
    """
    config = {**config, "master_server_address": master, "setup_timeout_s": 2.0, "retry_interval_s": 0.5}
    work = prompts(2, 48, 5, seed=4)
    Engine()  # imports done: the figure is the connect's
    start = time.monotonic()
    with Engine("mooncake", config) as engine:
        built = round(time.monotonic() - start, 3)
        times = timed_steps(engine)
        tokens = engine.generate(work, max_tokens=4)
        time.sleep(1.0)
        tokens += engine.generate(work, max_tokens=4)
        return {
            "build_s": built,
            "max_step_s": max(times),
            "same_tokens": tokens == Engine().generate(work + work, max_tokens=4),
            "stats": totals(engine),
        }


def wedged_master(config: Config, workdir: str) -> None:
    """Save, then run an engine while the test keeps the master paused (SIGSTOP), then again once resumed.

    Protocol with the test: prints ``SAVED`` and waits for ``workdir/paused``;
    prints ``WEDGED {json}`` and waits for ``workdir/resumed``; prints ``RESUMED {json}``.
    """
    config = {**config, "timeout_s": 1.0, "retry_interval_s": 0.5, "max_backoff_s": 2.0}
    work, later = prompts(3, 64, 6, seed=13), prompts(2, 64, 6, seed=14)
    baseline = Engine().generate(work + later, max_tokens=4)
    with Engine("mooncake", config) as engine:
        engine.generate(work, max_tokens=4)
        print("SAVED", flush=True)
        _wait_for(os.path.join(workdir, "paused"), 60)
        # Every prefix is a store lookup; its puts in the step (with save_async the one put of its only prefill step
        # would fail behind the run, after the last step: sdk/tests/test_store_saves_async.py has that case).
        with Engine("mooncake", {**config, "save_async": False}) as wedged:
            seen, times = reported(wedged), timed_steps(wedged)
            tokens = wedged.generate(work + later, max_tokens=4)
            print("WEDGED " + json.dumps({
                "same_tokens": tokens == baseline, "max_step_s": max(times), "steps": len(times),
                "stats": totals(wedged), "reported": seen,
            }), flush=True)  # fmt: skip
        _wait_for(os.path.join(workdir, "resumed"), 60)
        _wait_until_saving(engine, config, 30)  # the late call returns, then the background probes clear the trips
        # The put that missed its deadline while the master was paused may land once it runs again (its staging
        # was never reused): a prompt no engine has seen shows that saves resume.
        fresh = prompts(1, 64, 6, seed=16)
        with Engine("mooncake", config) as reader:
            tokens = reader.generate(work + later + fresh, max_tokens=4)
            same = tokens == baseline + Engine().generate(fresh, max_tokens=4)
            print("RESUMED " + json.dumps({"same_tokens": same, "stats": totals(reader)}), flush=True)


def late_master(config: Config, workdir: str, horizon_s: float = 20.0) -> None:
    """An engine started before its master: how soon after the master comes up its first block is saved.

    Protocol with the test: prints ``STARTED`` once the engine runs with the store off, and steps (a fresh
    prompt each time) until ``workdir/up`` appears (the test is starting the master); then until a block is
    saved or ``horizon_s`` passes. Prints ``SAVED {json}``: ``first_save_s`` (seconds from seeing ``up`` to the
    first save; ``None`` past the horizon), ``saved_before_up`` (saves while the master was down: must be 0),
    whether every output was exact.
    """
    config = {**config, "setup_timeout_s": 60.0, "retry_interval_s": 1.0}
    up_flag = os.path.join(workdir, "up")
    outputs: list[list[int]] = []
    work: list[list[int]] = []
    with Engine("mooncake", config) as engine:
        print("STARTED", flush=True)
        up_at: float | None = None
        saved_before_up = 0
        while up_at is None or (not totals(engine)["blocks_saved"] and time.monotonic() - up_at < horizon_s):
            if up_at is None and os.path.exists(up_flag):
                up_at, saved_before_up = time.monotonic(), totals(engine)["blocks_saved"]
            work += prompts(1, 48, 5, seed=1000 + len(work))
            outputs += engine.generate(work[-1:], max_tokens=2)
            time.sleep(0.05)  # a step every ~50 ms: the engine is busy, the machine's cores are not
        saved = totals(engine)["blocks_saved"] > 0
        print("SAVED " + json.dumps({
            "first_save_s": round(time.monotonic() - up_at, 2) if saved else None,
            "saved_before_up": saved_before_up, "same_tokens": outputs == Engine().generate(work, max_tokens=2),
            "stats": totals(engine),
        }), flush=True)  # fmt: skip


def poisoned(config: Config, secret: str | None = None) -> dict[str, Any]:
    """Another client writes first under this engine's keys (puts are first-writer-wins); nothing it wrote loads.

    It writes garbage of the right size, short values, and, when the engines
    share ``secret``, well-formed values sealed without it (which only the MAC
    tells from real ones). The engine loads nothing and computes exact tokens.
    """
    import torch

    if secret is not None:
        config = {**config, "integrity_secret": secret}
    work = prompts(2, 96, 5, seed=15)
    baseline = Engine().generate(work, max_tokens=4)
    other = {**config, "backend": "mooncake", "global_segment_size": 32 << 20}  # other settings: its own client
    attacker = open_store(msgspec.convert(other, MooncakeConfig))
    try:
        with Engine("mooncake", config) as engine:
            keys = connector(engine).side.keys  # keys are predictable: the attacker knows them
            size = HEADER_BYTES + sum(t[0].nbytes for t in engine.worker.kv_caches.values())
            hashes = list(dict.fromkeys(h for p in work for h in hash_blocks(p, engine.context.block_size)))
            kinds = 3 if secret is not None else 2
            values = []
            for i, h in enumerate(hashes):
                value = torch.randint(0, 256, (size,), dtype=torch.uint8)
                if i % kinds == 1:
                    value = value[: size // 2].clone()  # short
                elif i % kinds == 2:  # well-formed, checksummed, for the right key: but not sealed with the secret
                    payload = value[HEADER_BYTES:]
                    header = Integrity().seal(keys.key(0, h), bytes(8), memoryview(payload.numpy()))
                    value[:HEADER_BYTES] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
                values.append(value)
            stored = attacker.put([keys.key(0, h) for h in hashes], [memoryview(v.numpy()) for v in values])
            seen = reported(engine)
            tokens = engine.generate(work, max_tokens=4)
            return {"put": stored, "same_tokens": tokens == baseline, "stats": totals(engine), "reported": seen}
    finally:
        attacker.close()


def conformance(config: Config) -> dict[str, Any]:
    """kvconn's conformance suite against the real store ``config`` names; the report as a dict.

    The run holds its own store open, as a long-lived deployment keeps
    its client: every engine the suite creates shares that one client, and
    blocks outlive the engine that saved them (as with the embedded store,
    which lives as long as the process). Without it each engine's shutdown
    would close the client, which takes ~2 s in Mooncake 0.3.13.
    """
    from kvconn.testing.conformance import run_conformance

    full = msgspec.convert({"backend": "mooncake", **config}, MooncakeConfig)
    store = open_store(full)
    try:
        report = run_conformance("mooncake", config=msgspec.to_builtins(full))
    finally:
        store.close()
    return {"backend": "embedded" if resolve_backend(full) is None else "mooncake", "report": report.to_dict()}


def _wait_until_saving(engine: Engine, config: Config, timeout: float) -> None:
    """Until the store stores a value again and the engine's sides use it (probes cleared their trips).

    A restarted master answers lookups before the client has re-mounted its
    segment (puts are refused meanwhile): a put is the test that it is back.
    """
    store = open_store(msgspec.convert(config, MooncakeConfig))  # this process's client: the engine's
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(ConnectionError):  # down, or answering with an error code
                if store.put([f"kvconn-test/probe/{uuid.uuid4().hex}".encode()], [bytes(64)]) == [True]:
                    break
            time.sleep(0.2)
    finally:
        store.close()
    guards = [connector(engine, role).side.guard for role in ("worker", "scheduler")]
    while not all(g.available for g in guards) and time.monotonic() < deadline:
        time.sleep(0.2)


def _wait_for(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def events(config: Config) -> dict[str, Any]:
    """The scheduler side's KV events on a real store: the prompt's full blocks, stored once the master holds them."""
    work = prompts(1, prefix_len=64, suffix_len=3, seed=9)
    with Engine("mooncake", config, block_size=16, num_blocks=64) as engine:
        side = connector(engine, "scheduler").side
        first = side.take_events()  # an engine that publishes events asks before any step
        engine.generate(work, max_tokens=2)
        connector(engine).side.settle_saves()  # save_async: the last put may still be running
        taken = side.take_events()
    return {
        "first": [repr(e) for e in first],
        "kinds": [type(e).__name__ for e in taken],
        "stored": [h.hex() for e in taken if isinstance(e, BlockStored) for h in e.block_hashes],
        "expected": [h.hex() for h in hash_blocks(work[0], 16)],
    }


SCENARIOS: dict[str, Callable[..., Any]] = {
    "save_then_load": save_then_load,
    "fill_steps": fill_steps,
    "isolation": isolation,
    "store_full": store_full,
    "load_failures": load_failures,
    "producer": producer,
    "consumer": consumer,
    "master_fault": master_fault,
    "conformance": conformance,
    "connect_deadline": connect_deadline,
    "wedged_master": wedged_master,
    "late_master": late_master,
    "poisoned": poisoned,
    "events": events,
}


def main(argv: list[str]) -> None:
    """``scenarios.py CONFIG_JSON NAME [JSON_KWARGS]...``: run scenarios, print one JSON result line each."""
    extra = json.loads(argv[0])
    for name, kwargs in zip(argv[1::2], argv[2::2], strict=True):
        result = SCENARIOS[name](real_store_config(**extra), **json.loads(kwargs))
        if result is not None:
            print("RESULT " + json.dumps({"scenario": name, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


# ------------------------------------------------------ checks (both backends)


def check_save_then_load(r: dict[str, Any], block_size: int) -> None:
    assert r["first"] == r["baseline"] and r["second"] == r["baseline"]
    first, second = r["first_stats"], r["second_stats"]
    assert first["blocks_saved"] > 0 and first["prompt_tokens_loaded"] == 0
    assert second["prompt_tokens_loaded"] >= 3 * block_size  # the shared prefix came from the store
    assert second["blocks_loaded"] > 0 and second["failed_load_blocks"] == 0
    assert r["compared_blocks"] == r["prompt_blocks"] and r["kv_equal"]
    assert second["tracked"] == 0 and second["held"] == 0


def check_fill_steps(r: dict[str, Any]) -> None:
    assert r["violations"] == []
    assert r["no_alloc_fills"] >= 2  # blocks were filled (and saved) on steps that allocated nothing
    assert r["stats"]["blocks_saved"] == 4


def check_isolation(r: dict[str, Any]) -> None:
    hits = r["loaded_tokens"]
    assert hits.pop("same") > 0
    assert hits == dict.fromkeys(hits, 0)
    assert all(r["exact"].values()), r["exact"]


def check_failed_loads(r: dict[str, Any], counter: str) -> None:
    assert r["same_tokens"]
    assert r["stats"][counter] > 0 and r["stats"]["failed_load_blocks"] >= r["stats"][counter]
    assert r["stats"]["tracked"] == 0
