"""kvconn.store: a store connector over the in-memory store, on the reference engine, with faults."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvconn import CachedRequestData, KVCacheGroupSpec, SaveCursor, SchedulerOutput, loadable_hit
from kvconn.hashing import hash_blocks
from kvconn.reference import Engine
from kvconn.store import HEADER_BYTES, BlockStore, Integrity, StoreGuard, StoreScheduler, StoreUnavailable
from kvconn.telemetry import BlockRemoved, BlockStored
from kvconn.testing import memory_connector, memory_store, run_conformance
from kvconn.testing.store_conformance import StoreConformance

STORE = f"{memory_store.__name__}:MemoryStoreConnector"
SWA_GROUPS = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=32))
FAST = {"timeout_s": 0.5, "retry_interval_s": 0.05, "max_backoff_s": 0.1}


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    memory_store.clear()
    yield
    memory_store.clear()


def prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(32_000) for _ in range(70)]
    return [shared + [rng.randrange(32_000) for _ in range(25 + i)] for i in range(n)]


def run(*args: Any, **options: Any) -> tuple[list[list[int]], Engine]:
    """Each prompt finished before the next arrives, without a local prefix cache: hits come from the store."""
    with Engine(*args, **{"num_blocks": 128, "enable_prefix_caching": False, **options}) as engine:
        outputs = [engine.generate([p], max_tokens=12)[0] for p in prompts()]
    return outputs, engine


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return run()[0]


@pytest.mark.parametrize("load_async", [False, True])
def test_loads_replace_computation_exactly(baseline: list[list[int]], load_async: bool) -> None:
    outputs, engine = run(STORE, {"load_async": load_async})
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded >= 5 * 64
    assert engine.stats.degraded_events == 0


def test_sliding_window_groups_load_only_their_window() -> None:
    expected = run(kv_cache_groups=SWA_GROUPS)[0]
    outputs, engine = run(STORE, kv_cache_groups=SWA_GROUPS)
    assert outputs == expected
    assert engine.stats.prompt_tokens_loaded > 0


def test_blocks_of_many_kib_per_layer_round_trip_exactly() -> None:
    """Blocks of 16 KiB a layer are saved block by block (StoreWorker's large-block copy), loaded exactly."""
    shape = {"num_kv_heads": 4, "head_dim": 32}  # a block of one layer: 2 x 16 tokens x 4 x 32 float32 = 16 KiB
    expected = run(**shape)[0]
    for load_async in (False, True):
        memory_store.clear()
        outputs, engine = run(STORE, {"load_async": load_async}, **shape)
        assert outputs == expected
        assert engine.stats.prompt_tokens_loaded >= 5 * 64


def test_corrupt_values_never_reach_the_kv_cache_and_are_recomputed(baseline: list[list[int]]) -> None:
    memory_store.faults().corrupt = True
    outputs, engine = run(STORE, {"load_async": False})
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded == 0
    assert engine.stats.failed_load_blocks > 0


def test_a_store_down_degrades_to_no_hits_and_exact_outputs(baseline: list[list[int]]) -> None:
    memory_store.faults().down = True
    outputs, engine = run(STORE, FAST)
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded == 0
    assert engine.stats.degraded_events > 0


def test_a_stalled_store_costs_one_deadline_then_is_off(baseline: list[list[int]]) -> None:
    memory_store.faults().running.clear()
    try:
        outputs, engine = run(STORE, {**FAST, "retry_interval_s": 60.0})
    finally:
        memory_store.faults().running.set()
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded == 0


def test_a_block_whose_load_failed_is_not_offered_again() -> None:
    """vLLM re-asks right after a failed load: offering the same bad value again would livelock."""
    with Engine(STORE, {"load_async": True}, num_blocks=128, enable_prefix_caching=False) as engine:
        first, again = prompts(2)
        engine.generate([first], max_tokens=4)
        memory_store.faults().corrupt = True
        engine.generate([again], max_tokens=4)
        failed = engine.stats.failed_load_blocks
        assert failed > 0
        engine.generate([again], max_tokens=4)
        assert engine.stats.failed_load_blocks == failed  # not claimed, so not failed, again


def test_a_failed_block_is_offered_again_once_its_cool_down_ends() -> None:
    with Engine(STORE, {"failed_block_cooldown_steps": 20}, num_blocks=128, enable_prefix_caching=False) as engine:
        first, again = prompts(2)
        engine.generate([first], max_tokens=4)
        memory_store.faults().corrupt = True
        engine.generate([again], max_tokens=4)
        failed = engine.stats.failed_load_blocks
        memory_store.faults().corrupt = False
        engine.generate([again], max_tokens=4)
        assert engine.stats.failed_load_blocks == failed and engine.stats.prompt_tokens_loaded == 0  # cooling
        engine.generate([again], max_tokens=24)  # past the cool-down
        loaded = engine.stats.prompt_tokens_loaded
        engine.generate([again], max_tokens=4)
        assert engine.stats.prompt_tokens_loaded > loaded and engine.stats.failed_load_blocks == failed


def test_the_integrity_header_names_what_is_wrong() -> None:
    seal = Integrity()
    payload = memoryview(bytes(range(256)))
    value = bytearray(seal.seal(b"k", b"L" * 8, payload) + payload)
    assert len(value) == HEADER_BYTES + 256
    assert seal.verify(b"k", b"L" * 8, memoryview(value)) is None
    assert seal.verify(b"other", b"L" * 8, memoryview(value)) == "other_key"
    assert seal.verify(b"k", b"M" * 8, memoryview(value)) == "other_layout"
    assert Integrity("s" * 16).verify(b"k", b"L" * 8, memoryview(value)) == "unsigned"
    signed = bytearray(Integrity("s" * 16).seal(b"k", b"L" * 8, payload) + payload)
    assert seal.verify(b"k", b"L" * 8, memoryview(signed)) == "signed"
    assert seal.verify(b"k", b"L" * 8, memoryview(value[:-1])) == "short"
    reserved = bytearray(value)
    reserved[6] = 1  # the reserved field, which kvconn never sets
    assert seal.verify(b"k", b"L" * 8, memoryview(reserved)) == "foreign"
    value[-1] ^= 1
    assert seal.verify(b"k", b"L" * 8, memoryview(value)) == "checksum"
    assert seal.verify(b"k", b"L" * 8, memoryview(b"nonsense" * 10)) == "foreign"


def test_the_window_cut_ignores_misses_before_the_window() -> None:
    groups = (KVCacheGroupSpec(("a",)), KVCacheGroupSpec(("b",), sliding_window=32))
    stored = {(0, i) for i in range(10)} | {(1, i) for i in range(6, 10)}  # a 32-token window: 2 blocks
    assert loadable_hit(groups, 16, 0, 10, lambda g, i: (g, i) in stored) == 10
    stored.discard((1, 8))
    assert loadable_hit(groups, 16, 0, 10, lambda g, i: (g, i) in stored) == 8
    assert loadable_hit(groups, 16, 0, 10, lambda g, i: (g, i) in stored, step=3) == 0
    stored |= {(1, 3), (1, 4)}
    stored.discard((0, 5))  # a full-attention miss ends the hit there
    assert loadable_hit(groups, 16, 0, 10, lambda g, i: (g, i) in stored) == 5


def test_the_save_cursor_drops_back_to_recomputed_blocks() -> None:
    cursor = SaveCursor()
    cursor.start("r", 4)
    cached = CachedRequestData(req_ids=["r"], num_computed_tokens=[32])  # the step recomputes blocks 2..4
    out = SchedulerOutput(1, [], cached, {"r": 48}, 48)
    assert list(cursor.due(out, 16)) == [("r", 2, 5)]
    cursor.advance("r", 5)
    assert cursor.upto("r") == 5


class TestMemoryStore(StoreConformance):
    def make_store(self) -> BlockStore:
        return memory_store.MemoryStore(f"conformance-{id(self)}")

    def make_unreachable(self, store: BlockStore) -> None:
        assert isinstance(store, memory_store.MemoryStore)
        memory_store.faults(store.name).down = True


class TestPartsMemoryStore(TestMemoryStore):
    """``MemoryConnector``'s store, which also writes values from parts: ``put_parts`` is checked too."""

    def make_store(self) -> BlockStore:
        return memory_connector.PartsMemoryStore(f"conformance-parts-{id(self)}")


class _Overwrites(memory_connector.PartsMemoryStore):
    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        for key, value in zip(keys, parts, strict=True):
            self._values[key] = b"".join(value)  # put() keeps a key's first value; this overwrites it
        return [True] * len(keys)


class _DropsAPart(memory_connector.PartsMemoryStore):
    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        return self.put(keys, [b"".join([*value[:-1], bytes(value[-1].nbytes)]) for value in parts])


@pytest.mark.parametrize(
    ("broken", "message"),
    [(_Overwrites, "write-once"), (_DropsAPart, "the concatenation of its parts")],
    ids=["overwrites", "drops-a-part"],
)
def test_the_put_parts_check_fails_a_store_that_breaks_it(broken: type, message: str) -> None:
    """The conformance check of ``put_parts`` catches each way a store can get it wrong, and says how."""
    store = broken(f"broken-{broken.__name__}")
    with pytest.raises(AssertionError, match=message):
        StoreConformance().test_put_parts_stores_what_put_would(store)
    TestPartsMemoryStore().test_put_parts_stores_what_put_would(memory_connector.PartsMemoryStore("unbroken"))


def test_the_store_in_the_authoring_guide_passes_every_conformance_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/authoring.md's section 0 alone gives a connector that passes kvconn validate."""
    guide = (Path(__file__).parents[2] / "docs" / "authoring.md").read_text(encoding="utf-8")
    section = guide[guide.index("## 0. The first way") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    (tmp_path / "guide_store.py").write_text(code[: code.index("```")], encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    report = run_conformance("guide_store:DictConnector")
    assert report.load_error is None and report.failed == 0 and report.passed > 20, report


def test_a_store_that_comes_back_is_used_again(baseline: list[list[int]]) -> None:
    """Down: no hits, no saves, exact outputs; back: a background probe turns it on, and saves and hits resume."""
    memory_store.faults().down = True
    with Engine(STORE, FAST, num_blocks=128, enable_prefix_caching=False) as engine:
        first, again = prompts(2)
        assert engine.generate([first], max_tokens=12)[0] == baseline[0]
        assert engine.stats.blocks_saved == 0 and engine.stats.degraded_events > 0
        memory_store.faults().down = False
        assert engine.worker_host is not None and engine.scheduler_host is not None
        sides = [host.connectors[STORE].side for host in (engine.scheduler_host, engine.worker_host)]  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60  # the probe runs every max_backoff_s at most (0.1 s)
        while not all(side.guard.available for side in sides) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(side.guard.available for side in sides), "the probe never turned the store on again"
        assert engine.generate([first], max_tokens=12)[0] == baseline[0]  # saved now
        assert engine.generate([again], max_tokens=12)[0] == baseline[1]
        assert engine.stats.prompt_tokens_loaded > 0


class MetadataLost(StoreScheduler):
    """A scheduler side whose ``build_connector_meta`` raises while ``down`` (its metadata never goes out)."""

    down = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput, block_state: Any) -> Any:
        if MetadataLost.down:
            raise RuntimeError("metadata lost")
        return super().build_connector_meta(scheduler_output, block_state)


class MetadataLostConnector(memory_store.MemoryStoreConnector):
    scheduler_side = MetadataLost


def test_saves_of_a_finished_request_that_never_went_out_are_never_sent_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host releases a held request's blocks after its stall bound and hands them to the next request:
    sending the old request's saves then would store the new request's KV under the old request's keys."""
    first, other = prompts(2)
    other = [t + 1 for t in other]  # no prefix in common with ``first``
    with Engine(enable_prefix_caching=False) as plain:
        expected = plain.generate([first], max_tokens=4)[0]
    path = f"{__name__}:MetadataLostConnector"
    with Engine(path, num_blocks=16, enable_prefix_caching=False, stall_steps=4, stall_s=0) as engine:
        monkeypatch.setattr(MetadataLost, "down", True)
        assert engine.generate([first], max_tokens=4)[0] == expected  # held, then released by the host
        connector = engine.scheduler_host.connectors[path]  # type: ignore[union-attr]
        assert connector.side.get_num_tracked_requests() == 0
        monkeypatch.setattr(MetadataLost, "down", False)
        engine.generate([other], max_tokens=4)  # in the blocks ``first`` held
        saved = engine.stats.blocks_saved
        assert saved == len(other) // 16  # its own blocks only
        assert engine.generate([first], max_tokens=4)[0] == expected
        assert engine.stats.prompt_tokens_loaded == 0  # nothing was stored under first's keys


def test_an_in_process_store_is_called_on_the_callers_thread_and_a_raise_still_turns_it_off() -> None:
    name = "inline-guard"
    guard = StoreGuard(
        name, lambda: memory_store.MemoryStore(name), timeout_s=0.5, retry_interval_s=0.01, max_backoff_s=0.02,
        inline=True,
    )  # fmt: skip
    callers: list[int] = []

    def contains(store: BlockStore) -> list[bool]:
        callers.append(threading.get_ident())
        return list(store.contains([b"k"]))

    assert guard.call("contains", contains) == [False]
    assert guard.submit("contains", contains).result(timeout=0) == [False]  # done before it returns
    assert callers == [threading.get_ident()] * 2
    assert not [t.name for t in threading.enumerate() if t.name.startswith(f"kvconn-store-{name}")]
    memory_store.faults(name).down = True
    with pytest.raises(StoreUnavailable):
        guard.call("contains", contains)
    assert not guard.available and guard.trips == 1
    with pytest.raises(StoreUnavailable):  # off: not called at all
        guard.call("contains", contains)
    assert len(callers) == 3
    memory_store.faults(name).down = False
    deadline = time.monotonic() + 30
    while not guard.available and time.monotonic() < deadline:
        time.sleep(0.01)
    assert guard.available, "the probe never turned the store on again"
    guard.close()


def test_in_process_store_is_the_deprecated_name_of_inline_calls() -> None:
    """Renamed: too close to KVConnector.in_process_state (where the sides may run), a different setting."""
    with pytest.warns(DeprecationWarning, match="declare inline_calls = True"):

        class OldName(memory_store.MemoryStoreConnector):
            in_process_store = True

    assert OldName.inline_calls is True
    assert memory_store.MemoryStoreConnector.inline_calls is False


def test_a_store_connector_gives_each_run_a_namespace_of_its_own(tmp_path: Path) -> None:
    first, second = (memory_store.MemoryStoreConnector.fresh_store_config("KV045", tmp_path) for _ in range(2))
    assert first is not None and second is not None
    assert set(first) == {"namespace"} and first != second and first["namespace"].startswith("KV045-")


class _UnreachableTooSlowly(memory_store.MemoryStore):
    """Raises once unreachable, but only after its client's own timeout, longer than the connector's deadline."""

    down = False

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if self.down:
            time.sleep(0.3)
            raise ConnectionError("timed out")
        return list(super().contains(keys))


def test_the_store_kit_fails_a_store_whose_own_timeout_outlasts_the_deadline() -> None:
    class Kit(StoreConformance):
        deadline_s = 0.1

        def make_store(self) -> BlockStore:
            return _UnreachableTooSlowly(f"too-slow-{random.random()}")

        def make_unreachable(self, store: BlockStore) -> None:
            assert isinstance(store, _UnreachableTooSlowly)
            store.down = True

    kit = Kit()
    store = kit.make_store()
    with pytest.raises(AssertionError, match=r"contains\(\) on an unreachable store raised after 0\.\d+ s, past"):
        kit.test_an_unreachable_store_raises_in_bounded_time(store)


def test_store_stats_report_degraded_events_by_reason_and_the_scheduler_side_reports_its_own() -> None:
    from kvconn.connector import KVConnector
    from kvconn.store import StoreConnector
    from kvconn.store.stats import StoreStats

    stats = StoreStats("test")
    stats.count("blocks_saved", 2)
    stats.degraded("save_failed_refused", 3, "the store refused values")
    stats.degraded("lookup_failed", 1, "lookups failed")
    assert stats.take() == {
        "blocks_saved": 2.0, "save_failed_refused": 3.0, "lookup_failed": 1.0, "degraded_events": 4.0,
        "degraded.save_failed_refused": 3.0, "degraded.lookup_failed": 1.0,
    }  # fmt: skip
    assert stats.take() == {}
    assert StoreConnector.cache_tier == "remote" and KVConnector.cache_tier is None
    assert callable(StoreScheduler.scheduler_stats)


def test_events_announce_only_what_the_store_holds_and_the_blocks_whose_load_failed() -> None:
    """Stored: confirmed by the store, never on a save that did not land. Removed: a load that failed."""
    with Engine(STORE, FAST, num_blocks=128, enable_prefix_caching=False) as engine:
        assert engine.scheduler_host is not None
        side = engine.scheduler_host.connectors[STORE].side
        assert side.take_events() == []  # an engine that publishes events asks first
        first, other = prompts(2)
        size = engine.context.block_size

        def blocks(prompt: list[int]) -> list[bytes]:
            return hash_blocks(prompt, size)[: (len(prompt) - 1) // size]  # saved: full blocks before the last token

        def taken(kind: type) -> list[bytes]:
            return [h for e in side.take_events() if isinstance(e, kind) for h in e.block_hashes]

        engine.generate([first], max_tokens=4)
        stored = taken(BlockStored)  # the prompt's full blocks first (then any a generated token filled)
        assert stored[: len(blocks(first))] == blocks(first) and len(set(stored)) == len(stored)
        memory_store.faults().corrupt = True
        engine.generate([first], max_tokens=4)
        assert engine.stats.failed_load_blocks > 0
        removed = taken(BlockRemoved)
        assert removed and set(removed) <= set(blocks(first))
        memory_store.faults().corrupt = False
        memory_store.faults().down = True
        engine.generate([other[-40:]], max_tokens=4)  # no prefix shared with first
        assert taken(BlockStored) == []  # nothing landed: nothing announced
