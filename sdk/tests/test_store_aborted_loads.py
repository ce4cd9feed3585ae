"""A request aborted while its async load is in flight: the store layer reports the load when it lands, and the
engine holds the request's blocks until then (vLLM's ``Scheduler.finish_requests``), so nothing the late load
writes lands in another request's blocks."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from kvconn.reference import Engine
from kvconn.store import BlockStore
from kvconn.testing import memory_store

#: set: gets proceed; cleared: every get waits (lookups and saves do not)
GETS = threading.Event()


class GatedGetsStore(memory_store.MemoryStore):
    def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int | None]:
        assert GETS.wait(5), "the test never opened the gate"
        return super().get(keys, buffers)


class GatedGets(memory_store.MemoryStoreConnector):
    def open_store(self) -> BlockStore:
        return GatedGetsStore(self.config.store)


@pytest.fixture(autouse=True)
def _gate() -> Iterator[None]:
    memory_store.clear()
    GETS.set()
    yield
    GETS.set()
    memory_store.clear()


def test_an_aborted_requests_load_is_reported_when_it_lands_and_its_blocks_held_until_then() -> None:
    prompt = list(range(1_000, 1_070))
    with Engine(f"{__name__}:GatedGets", {"load_async": True}, num_blocks=32, enable_prefix_caching=False) as engine:
        engine.generate([prompt], max_tokens=3)  # saved: four full blocks
        free = engine.scheduler.kv_cache_manager.num_free_blocks
        GETS.clear()
        engine.add_request(prompt, 3, request_id="again")
        engine.step()  # admitted: its blocks allocated, its get submitted (and waiting at the gate)
        assert "again" in engine.scheduler.requests and engine.scheduler.kv_cache_manager.num_free_blocks < free
        engine.abort("again")
        for _ in range(3):
            engine.step()
        assert engine.scheduler.held_requests == {"again"}  # the worker may still write into them
        GETS.set()
        for _ in range(500):
            if not engine.scheduler.held_requests:
                break
            engine.step()
        assert not engine.scheduler.held_requests
        assert engine.scheduler.kv_cache_manager.num_free_blocks == free
