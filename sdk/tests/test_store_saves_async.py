"""kvconn.store with ``save_async``: a step's put runs on a store thread while the engine goes on.

What must hold: the engine never waits for the put (only for the copy into
staging), a held request is released as soon as its blocks are copied, the
put never reads a KV cache the engine may change meanwhile, one put is in
flight at a time, and a put that raises or outlives its deadline degrades to
"not saved" like a sync one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from kvconn import ConnectorContext, KVCacheGroupSpec, KVConnectorRole
from kvconn.reference import Engine
from kvconn.store import BlockStore, StoreBlock, StoreConnector, StoreMetadata, StoreScheduler
from kvconn.store.worker import StoreWorker
from kvconn.testing import memory_store, run_conformance
from kvconn.testing.memory_connector import PartsMemoryStore
from kvconn.testing.memory_store import MemoryStore, faults

GROUPS = (KVCacheGroupSpec(("layer.0", "layer.1")),)
SHAPE = (2, 4, 8)  # per block


class CountingPartsStore(PartsMemoryStore):
    """A :class:`~kvconn.store.PartsStore` that records which write call each save used."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: list[str] = []

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.calls.append("put_parts")
        return MemoryStore.put(self, keys, [b"".join(value) for value in parts])

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        self.calls.append("put")
        return super().put(keys, values)


class AsyncConnector(StoreConnector):
    stores: ClassVar[dict[str, CountingPartsStore]] = {}

    def open_store(self) -> BlockStore:
        return self.stores.setdefault(self.config.namespace, CountingPartsStore(self.config.namespace))


def _worker(namespace: str, **options: object) -> tuple[StoreWorker, dict[str, torch.Tensor]]:
    config = AsyncConnector.Config(namespace=namespace, **options)  # type: ignore[arg-type]
    side = AsyncConnector(config, role=KVConnectorRole.WORKER, context=ConnectorContext(kv_cache_groups=GROUPS)).side
    assert isinstance(side, StoreWorker)
    kv = {name: torch.randn((8, *SHAPE)) for name in GROUPS[0].layer_names}
    side.register_kv_caches(kv)
    side.guard.call("open", lambda store: store.contains([]))
    return side, kv


def _step(worker: StoreWorker, saves: list[StoreBlock], held: Sequence[str] = ()) -> set[str]:
    """One worker step that saves ``saves``: what it reports in ``finished_sending``."""
    worker.start_load_kv(StoreMetadata(saves=saves, finished_saves=list(held), load_async=False))
    worker.wait_for_save()
    return worker.get_finished(set())[0]


def _settled(worker: StoreWorker, seconds: float = 10.0) -> dict[str, float]:
    """Empty steps until the put in flight is counted (or ``seconds`` pass): the stats of those steps."""
    deadline = time.monotonic() + seconds
    while worker._saving is not None and time.monotonic() < deadline:
        time.sleep(0.005)
        _step(worker, [])
    return worker.get_kv_connector_stats()


def test_the_put_runs_behind_the_step_from_staging_and_a_held_request_is_released_at_once() -> None:
    namespace = uuid.uuid4().hex
    writer, src = _worker(namespace, save_async=True)
    saved = {name: t[1].clone() for name, t in src.items()}
    faults(namespace).running.clear()  # every store call blocks: the put stays in flight
    try:
        began = time.monotonic()
        assert _step(writer, [StoreBlock("a", 0, 1, bytes(32))], held=["a"]) == {"a"}
        assert time.monotonic() - began < 1.0  # did not wait for the blocked put (deadline 2 s)
        for t in src.values():
            t[1].fill_(7.0)  # the engine reuses the released block while the put is still in flight
        assert "blocks_saved" not in writer.get_kv_connector_stats()
    finally:
        faults(namespace).running.set()
    assert _settled(writer)["blocks_saved"] == 1
    assert AsyncConnector.stores[namespace].calls == ["put"]  # staged, though the store could read in place
    reader, dst = _worker(namespace)
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("b", 0, 5, bytes(32))], load_async=False))
    assert reader.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dst[name][5], saved[name]) for name in dst)  # what was computed, not what came after


def test_settle_saves_waits_for_the_put_in_flight_and_counts_it() -> None:
    """What a tool reading the store right after a step calls: the store as the step left it."""
    namespace = uuid.uuid4().hex
    writer, _ = _worker(namespace, save_async=True)
    writer.settle_saves()  # nothing in flight: returns at once
    faults(namespace).running.clear()  # the put blocks until the timer lets the store run (deadline 2 s)
    _step(writer, [StoreBlock("a", 0, 1, bytes(32))])
    timer = threading.Timer(0.2, faults(namespace).running.set)
    timer.start()
    try:
        writer.settle_saves()
        assert writer.get_kv_connector_stats()["blocks_saved"] == 1
        assert AsyncConnector.stores[namespace].contains([writer.keys.key(0, bytes(32))]) == [True]
    finally:
        timer.cancel()
        faults(namespace).running.set()


def test_one_put_is_in_flight_at_a_time_and_a_late_one_degrades_to_not_saved() -> None:
    namespace = uuid.uuid4().hex
    writer, _ = _worker(namespace, save_async=True, timeout_s=0.2, retry_interval_s=60.0)
    faults(namespace).running.clear()
    try:
        _step(writer, [StoreBlock("a", 0, 1, bytes([1]) * 32), StoreBlock("a", 0, 2, bytes([2]) * 32)])
        began = time.monotonic()
        _step(writer, [StoreBlock("a", 0, 3, bytes([3]) * 32)])  # waits for the first put, up to its deadline
        assert time.monotonic() - began >= 0.15
        assert not writer.guard.available  # the late put tripped the store; the second save found it off
        stats = writer.get_kv_connector_stats()
        assert stats["save_failed_store_off"] == 3 and "blocks_saved" not in stats
    finally:
        faults(namespace).running.set()


def test_a_put_found_late_by_get_finished_trips_the_store() -> None:
    namespace = uuid.uuid4().hex
    writer, _ = _worker(namespace, save_async=True, timeout_s=0.1, retry_interval_s=60.0)
    faults(namespace).running.clear()
    try:
        _step(writer, [StoreBlock("a", 0, 1, bytes(32))])
        time.sleep(0.15)
        assert _step(writer, []) == set()
        assert not writer.guard.available and writer._saving is None
        assert writer.get_kv_connector_stats()["save_failed_store_off"] == 1
    finally:
        faults(namespace).running.set()


def test_a_put_that_raises_degrades_and_turns_the_store_off() -> None:
    namespace = uuid.uuid4().hex
    writer, _ = _worker(namespace, save_async=True, retry_interval_s=60.0)
    faults(namespace).down = True
    _step(writer, [StoreBlock("a", 0, 1, bytes(32))])
    assert _settled(writer)["save_failed_store_off"] == 1
    assert not writer.guard.available


def test_a_clean_shutdown_lets_the_put_in_flight_land() -> None:
    namespace = uuid.uuid4().hex
    writer, src = _worker(namespace, save_async=True)
    faults(namespace).running.clear()
    _step(writer, [StoreBlock("a", 0, 2, bytes(32))])
    release = threading.Timer(0.1, faults(namespace).running.set)
    release.start()
    writer.shutdown()  # waits for the put, which returns once the store runs again
    release.join()
    reader, dst = _worker(namespace)
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("b", 0, 6, bytes(32))], load_async=False))
    assert reader.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dst[name][6], src[name][2]) for name in dst)


STORE = f"{memory_store.__name__}:MemoryStoreConnector"


@pytest.mark.parametrize("load_async", [False, True])
def test_outputs_are_exact_and_later_requests_hit_what_async_puts_saved(load_async: bool) -> None:
    """The reference engine over the in-memory store (on store threads): each prompt finished before the next."""
    memory_store.clear()
    prompts = [[(7 * j) % 500 for j in range(70)] + [i] * (25 + i) for i in range(4)]
    options = {"num_blocks": 128, "enable_prefix_caching": False}
    with Engine(**options) as engine:
        baseline = [engine.generate([p], max_tokens=12)[0] for p in prompts]
    with Engine(STORE, {"save_async": True, "load_async": load_async}, **options) as engine:
        outputs = [engine.generate([p], max_tokens=12)[0] for p in prompts]
    memory_store.clear()
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded >= 3 * 64  # every later request loaded the shared 64 tokens
    assert engine.stats.degraded_events == 0


def test_a_store_connector_saving_async_passes_every_conformance_check() -> None:
    """The checks load right after saving: the scheduler offers what is in flight, the worker reads its writes."""
    report = run_conformance(STORE, config_factory=lambda run: {**memory_store.fresh_store(run), "save_async": True})
    assert report.load_error is None
    assert report.failed == 0 and report.skipped == 0, report.results


def test_a_lookup_counts_a_save_in_flight_as_stored_only_until_its_deadline() -> None:
    config = AsyncConnector.Config(namespace=uuid.uuid4().hex, save_async=True, timeout_s=0.2)
    side = AsyncConnector(config, role=KVConnectorRole.SCHEDULER, context=ConnectorContext(kv_cache_groups=GROUPS)).side
    assert isinstance(side, StoreScheduler)
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert side._lookup(hashes, 0, 3) == 0  # the store holds none of them
    side._in_flight[(0, hashes[0])] = side._in_flight[(0, hashes[1])] = time.monotonic()  # sent for saving now
    assert side._lookup(hashes, 0, 3) == 2
    time.sleep(0.25)  # past the put's deadline: it returned or failed, and the store answers for itself
    assert side._lookup(hashes, 0, 3) == 0 and not side._in_flight
