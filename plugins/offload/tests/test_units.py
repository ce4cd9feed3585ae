"""Config, pin gating, the manager and the delayed-free protocol, without an engine."""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import pytest
import torch

from kvconn import ConnectorConfigError, KVConnectorBlockState, KVConnectorOutput, load_connector
from kvconn.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from kvconn.reference.request import Request
from kvconn_offload import BlockCopier, BlockTransfer, CopyPlan, OffloadManager, OffloadMetadata, wide_rows
from kvconn_offload.copy import MAX_RUNS, PARALLEL_ELEMS, PathChooser
from kvconn_offload.scheduler import BLOCKING_COPIES_STAT, LOADS_DONE_STAT, STORES_DONE_STAT


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"pool_blocks": 0}, "field 'pool_blocks': expected int >= 1"),
        ({"pool_blocks": 4, "pool_bytes": 4096}, "set only one of pool_blocks and pool_bytes"),
        ({"block_size_multiple": 0}, "field 'block_size_multiple': expected int >= 1"),
        ({"pin_memory": "sometimes"}, "field 'pin_memory'"),
        ({"eviction": "mru"}, "field 'eviction'"),
        ({"load_async": "sometimes"}, "field 'load_async'"),
        ({"pool_size": 3}, "unknown field 'pool_size'; valid fields: pool_blocks, pool_bytes"),
    ],
)
def test_bad_config_names_the_field(config: dict, message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        load_connector("offload", role="scheduler", config=config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_pin_always_without_an_accelerator_is_a_config_error() -> None:
    with pytest.raises(ConnectorConfigError, match="'always' needs a CUDA device"):
        load_connector("offload", role="worker", config={"pin_memory": "always"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_pin_auto_uses_pageable_memory_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    worker = load_connector("offload", role="worker", config={"pool_bytes": 1 << 16}).side
    caplog.set_level(logging.INFO, logger="kvconn_offload")
    worker.register_kv_caches({f"layer.{i}": torch.zeros(8, 2, 16, 2, 8, dtype=torch.float16) for i in range(2)})
    lines = [r.getMessage() for r in caplog.records if "pageable" in r.getMessage()]
    assert len(lines) == 1 and "no accelerator" in lines[0]
    assert not worker.pool.is_pinned()
    assert worker.num_slots == (1 << 16) // (2 * 2 * 16 * 2 * 8 * 2)
    worker.shutdown()
    assert worker.pool is None


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
def test_the_pool_is_committed_when_the_caches_are_registered() -> None:
    """No save pays the page faults of a fresh pool inside a step: its pages are in memory from the start."""
    pool_bytes = 128 << 20
    worker = load_connector("offload", role="worker", config={"pool_bytes": pool_bytes, "pin_memory": "never"}).side
    before = _resident_bytes()
    worker.register_kv_caches({f"layer.{i}": torch.zeros(8, 2, 16, 2, 8, dtype=torch.float16) for i in range(2)})
    assert _resident_bytes() - before >= 0.9 * pool_bytes
    assert not worker.pool.any()
    worker.shutdown()


def test_manager_never_evicts_pinned_or_pending_entries() -> None:
    manager = OffloadManager(2)
    keys = [bytes([i]) * 32 for i in range(4)]
    assert [e.slot for _, e in manager.prepare_store(keys[:2])] == [0, 1]
    assert manager.prepare_store(keys[2:3]) == []  # both pending
    manager.complete_store(keys[:2])
    manager.prepare_load([keys[0]])  # pinned by a load
    ((key, entry),) = manager.prepare_store(keys[2:3])
    assert key == keys[2] and entry.slot == 1 and manager.lookup(keys) == 1  # keys[1] evicted, keys[0] kept
    assert manager.prepare_store(keys[3:]) == []  # keys[0] pinned, keys[2] pending
    manager.complete_load([keys[0]])
    assert [e.slot for _, e in manager.prepare_store(keys[3:])] == [0]


def test_lru_touch_changes_the_victim_and_fifo_ignores_it() -> None:
    keys = [bytes([i]) * 32 for i in range(3)]
    for policy, survivor in (("lru", keys[0]), ("fifo", keys[1])):
        manager = OffloadManager(2, policy=policy)
        manager.prepare_store(keys[:2])
        manager.complete_store(keys[:2])
        manager.touch([keys[0]])
        manager.prepare_store(keys[2:])
        assert manager.get(survivor) is not None and len(manager) == 2


def test_manager_records_what_became_loadable_and_what_left_only_once_asked() -> None:
    keys = [bytes([i]) * 32 for i in range(4)]
    manager = OffloadManager(2)
    manager.prepare_store(keys[:1])
    manager.complete_store(keys[:1])
    assert manager._stored is None  # nobody asked: nothing kept
    assert manager.take_changes() == ([], [])
    manager.prepare_store(keys[1:2])
    manager.complete_store(keys[1:2])
    manager.prepare_store(keys[2:3])  # evicts keys[0] (LRU)
    manager.complete_store(keys[2:3], success=False)  # a failed store is never announced
    manager.forget([keys[1]])  # found stale
    assert manager.take_changes() == ([keys[1]], [keys[0], keys[1]])
    assert manager.take_changes() == ([], [])


def test_offload_declares_host_tier_and_reports_its_pool() -> None:
    from kvconn.telemetry import BlockRemoved, BlockStored
    from kvconn_offload import OffloadConnector

    assert OffloadConnector.cache_tier == "host"
    assert {m.name: m.kind for m in OffloadConnector.metrics} == {
        "pool_used_blocks": "gauge", "pool_blocks": "gauge", "evictions": "counter"
    }  # fmt: skip
    side = load_connector("offload", role="scheduler", config={"pool_blocks": 1}).side
    assert side.take_events() == []  # an engine that publishes events asks before any block is stored
    assert side.scheduler_stats() == {"pool_used_blocks": 0, "pool_blocks": 1, "evictions": 0}
    keys = [bytes([i]) * 32 for i in range(2)]
    for key in keys:
        side.manager.prepare_store([key])
        side.manager.complete_store([key])
    assert side.scheduler_stats() == {"pool_used_blocks": 1, "pool_blocks": 1, "evictions": 1}
    assert side.scheduler_stats()["evictions"] == 0  # since the last call
    assert side.take_events() == [BlockStored(keys, 16), BlockRemoved(keys[:1])]


def _step(req: Request, num_computed: int, n: int, table: tuple[list[int], ...]) -> tuple[SchedulerOutput, object]:
    output = SchedulerOutput(
        step=0,
        scheduled_new_reqs=[NewRequestData(req.request_id, req.all_token_ids, table, num_computed)],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={req.request_id: n},
        total_num_scheduled_tokens=n,
    )
    return output, KVConnectorBlockState({req.request_id}, lambda _: table)


def test_finished_request_keeps_its_blocks_until_its_store_is_done() -> None:
    sched = load_connector("offload", role="scheduler", config={"pool_blocks": 8}).side
    req = Request("a", list(range(100, 140)), 4, 16)
    table = ([3, 5, 9],)
    sched.update_state_after_alloc(req, table, 0)
    output, state = _step(req, 0, 40, table)
    meta = sched.build_connector_meta(output, state)
    assert isinstance(meta, OffloadMetadata) and meta.store_seq == 1
    assert meta.block_ids_by_request() == {"a": ([3, 5],)}  # the partial third block is not stored
    meta = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=OffloadMetadata)
    assert sched.request_finished(req) is True  # store job 1 not reported done yet
    sched.update_connector_output(KVConnectorOutput(stats={STORES_DONE_STAT: 1}))
    assert sched.get_num_tracked_requests() == 1
    nxt = sched.build_connector_meta(*_step(Request("b", [1], 1, 16), 0, 1, ([],)))
    assert nxt.delayed_frees == ["a"]
    sched.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert sched.get_num_tracked_requests() == 0
    # the store is complete: a request with the same prefix hits both blocks
    assert sched.get_num_new_matched_tokens(Request("c", list(range(100, 140)), 4, 16), 0) == (32, True)


@pytest.mark.parametrize(
    ("load_async", "blocking", "expected"),
    [("auto", 1.0, False), ("auto", 0.0, True), (True, 1.0, True), (False, 0.0, False)],
    ids=["auto-host", "auto-accelerator", "true", "false"],
)
def test_load_async_auto_follows_whether_the_workers_copies_block_the_step(
    load_async: bool | str, blocking: float, expected: bool
) -> None:
    """On host KV caches the copies block the step either way: a hit loads in the step that computes the prompt."""
    sched = load_connector("offload", role="scheduler", config={"pool_blocks": 8, "load_async": load_async}).side
    prompt = list(range(100, 140))
    writer = Request("a", prompt, 4, 16)
    sched.update_state_after_alloc(writer, ([3, 5, 9],), 0)
    sched.build_connector_meta(*_step(writer, 0, 40, ([3, 5, 9],)))
    sched.update_connector_output(KVConnectorOutput(stats={STORES_DONE_STAT: 1, BLOCKING_COPIES_STAT: blocking}))
    assert sched.get_num_new_matched_tokens(Request("c", prompt, 4, 16), 0) == (32, expected)


def test_blocks_a_load_found_stale_are_no_longer_offered() -> None:
    """A store the worker dropped (the engine broke the step order) is forgotten once a load finds it missing."""
    sched = load_connector("offload", role="scheduler", config={"pool_blocks": 8}).side
    prompt = list(range(100, 140))
    writer = Request("a", prompt, 4, 16)
    sched.update_state_after_alloc(writer, ([3, 5, 9],), 0)
    sched.build_connector_meta(*_step(writer, 0, 40, ([3, 5, 9],)))  # store job 1: blocks 0 and 1
    sched.update_connector_output(KVConnectorOutput(stats={STORES_DONE_STAT: 1}))  # done, but nothing was kept
    reader = Request("c", prompt, 4, 16)
    assert sched.get_num_new_matched_tokens(reader, 0) == (32, True)
    sched.update_state_after_alloc(reader, ([7, 8, 2],), 32)
    meta = sched.build_connector_meta(*_step(reader, 32, 8, ([7, 8, 2],)))
    assert meta.block_ids_by_request() == {"c": ([7, 8],)}
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids={7}))  # the worker found block 0's slot stale
    assert sched.get_num_new_matched_tokens(Request("d", prompt, 4, 16), 0) == (32, True)  # still pinned by "c"
    sched.update_connector_output(KVConnectorOutput(finished_recving={"c"}))
    assert sched.get_num_new_matched_tokens(Request("d", prompt, 4, 16), 0) == (0, False)  # recomputed, saved again


def test_sync_loads_end_when_the_worker_reports_their_number() -> None:
    """A sync load's slots stay pinned until a report covers its batch (vLLM may build a step before the last report).

    Its worker never names it in ``finished_recving`` (the host fails a connector reporting a sync load).
    """
    sched = load_connector("offload", role="scheduler", config={"pool_blocks": 8, "load_async": False}).side
    prompt = list(range(100, 140))
    writer = Request("a", prompt, 4, 16)
    sched.update_state_after_alloc(writer, ([3, 5, 9],), 0)
    sched.build_connector_meta(*_step(writer, 0, 40, ([3, 5, 9],)))
    sched.update_connector_output(KVConnectorOutput(stats={STORES_DONE_STAT: 1}))
    reader = Request("c", prompt, 4, 16)
    assert sched.get_num_new_matched_tokens(reader, 0) == (32, False)
    sched.update_state_after_alloc(reader, ([7, 8, 2],), 32)
    meta = sched.build_connector_meta(*_step(reader, 32, 8, ([7, 8, 2],)))
    assert meta.load_seq == 1 and meta.block_ids_by_request() == {"c": ([7, 8],)}
    sched.update_connector_output(KVConnectorOutput())  # the report of an earlier step
    assert sched.manager.get(reader.block_hashes[0]).pins == 1
    sched.update_connector_output(KVConnectorOutput(stats={LOADS_DONE_STAT: 1}))
    assert sched.manager.get(reader.block_hashes[0]).pins == 0

    worker, kv = _worker_with_caches()
    sync = OffloadMetadata(store_seq=1, stores=[_transfer("a", [1, 2], [0, 1])])
    _worker_step(worker, sync)
    assert _worker_step(worker, OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])], load_seq=4)) == (set(), set())
    assert worker.get_kv_connector_stats()[LOADS_DONE_STAT] == 4
    assert all(torch.equal(t[5:7], t[1:3]) for t in kv.values())  # copied before the step's compute


def _worker_with_caches() -> tuple[Any, dict[str, torch.Tensor]]:
    worker = load_connector("offload", role="worker", config={"pool_blocks": 4}).side
    gen = torch.Generator().manual_seed(0)
    kv = {f"layer.{i}": torch.randn(8, 2, 16, 2, 8, generator=gen).half() for i in range(2)}
    kv["layer.0"][5:].zero_()
    kv["layer.1"][5:].zero_()
    worker.register_kv_caches(kv)
    return worker, kv


def _transfer(req_id: str, device: list[int], slots: list[int]) -> BlockTransfer:
    return BlockTransfer(req_id, [device], [slots], slots=slots, keys=[bytes([s]) * 32 for s in slots])


def _worker_step(worker: Any, meta: OffloadMetadata, *, saves_first: bool = False) -> tuple[set[str], set[str]]:
    """One worker step in kvconn's order, or (``saves_first``) with the layers saved before the step is set up."""
    if saves_first:
        for name in ("layer.0", "layer.1"):
            worker.save_kv_layer(name)
    worker.start_load_kv(meta)
    if not saves_first:
        for name in ("layer.0", "layer.1"):
            worker.save_kv_layer(name)
    worker.wait_for_save()
    return worker.get_finished()


def test_saves_before_the_step_is_set_up_mark_no_slot_stored() -> None:
    worker, kv = _worker_with_caches()
    _worker_step(worker, OffloadMetadata(store_seq=1, stores=[_transfer("a", [1, 2], [0, 1])]), saves_first=True)
    stats = worker.get_kv_connector_stats()
    assert stats.get("blocks_saved", 0) == 0 and stats.get("bytes_saved", 0) == 0  # no copy was made
    _, recving = _worker_step(worker, OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])]))
    assert recving == {"b"} and worker.get_block_ids_with_load_errors() == {5, 6}  # recomputed, not loaded
    assert not kv["layer.0"][5:7].any() and worker.get_kv_connector_stats().get("blocks_loaded", 0) == 0
    # in kvconn's order the same store is kept and loads back bit-exact
    _worker_step(worker, OffloadMetadata(store_seq=2, stores=[_transfer("a", [1, 2], [0, 1])]))
    assert worker.get_kv_connector_stats()["blocks_saved"] == 2
    _worker_step(worker, OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])]))
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(t[5:7], t[1:3]) for t in kv.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (on CUDA saves are issued per layer)")
def test_cpu_saves_run_together_at_wait_for_save_and_keep_what_each_layer_held() -> None:
    """On CPU a step's saves are copied in ``wait_for_save``, not between layers (the first copy after a layer's
    compute ran 4-5x slower): the pool is untouched until then, and then holds every layer's blocks bit-exact."""
    worker, kv = _worker_with_caches()
    worker.start_load_kv(OffloadMetadata(store_seq=1, stores=[_transfer("a", [1, 2], [0, 1])]))
    for name in ("layer.0", "layer.1"):
        worker.save_kv_layer(name)
    assert not worker.pool.any(), "a CPU save was copied before wait_for_save"
    worker.wait_for_save()
    worker.get_finished()
    assert worker.get_kv_connector_stats()["blocks_saved"] == 2
    assert all(torch.equal(worker.pool[i, 0:2], kv[f"layer.{i}"][1:3]) for i in range(2))
    _worker_step(worker, OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])]))
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(t[5:7], t[1:3]) for t in kv.values())


def test_one_step_loads_several_requests_and_reports_only_stale_slots() -> None:
    worker, kv = _worker_with_caches()
    stores = [_transfer("a", [1, 2], [0, 1]), _transfer("b", [3], [2])]
    _worker_step(worker, OffloadMetadata(store_seq=1, stores=stores))
    stale = BlockTransfer("d", [[7]], [[3]], slots=[3], keys=[b"never stored"])
    loads = [_transfer("c", [5], [0]), _transfer("e", [6], [2]), stale]
    _, recving = _worker_step(worker, OffloadMetadata(loads=loads))
    assert recving == {"c", "d", "e"} and worker.get_block_ids_with_load_errors() == {7}
    assert worker.get_kv_connector_stats()["blocks_loaded"] == 2
    assert all(torch.equal(t[5], t[1]) and torch.equal(t[6], t[3]) and not t[7].any() for t in kv.values())


@pytest.mark.parametrize("row_elems", [64, 1 << 15])  # short runs: staged fallback; long rows: one pass per run
@pytest.mark.parametrize("scattered", [False, True])
def test_copier_round_trip_is_bit_exact(row_elems: int, scattered: bool) -> None:
    gen = torch.Generator().manual_seed(row_elems)
    kv = torch.randn(64, row_elems, generator=gen).half()
    pool = torch.zeros(2, 96, row_elems, dtype=torch.float16)
    copier = BlockCopier(wide_rows(pool, 2))
    device = torch.randperm(64, generator=gen)[:40].tolist()
    host = torch.randperm(96, generator=gen)[:40].tolist() if scattered else list(range(40))
    plan = CopyPlan.build(device, host)
    assert (len(plan.runs) > MAX_RUNS) == scattered
    copier.save(1, wide_rows(kv), plan)
    assert torch.equal(pool[1, host], kv[device]) and not pool[0].any()
    back = torch.zeros_like(kv)
    copier.load(1, wide_rows(back), plan)
    assert torch.equal(back[device], kv[device])
    with pytest.raises(IndexError, match="out of range"):
        copier.save(1, wide_rows(kv[:10]), plan)  # block ids past the cache: refused, never clipped


@pytest.mark.parametrize("threads", [1, 2])
def test_long_runs_go_through_torchs_kernels_only_when_torch_has_threads(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    index_select, index_copy_ = torch.index_select, torch.Tensor.index_copy_

    def select(*args: Any, **kwargs: Any) -> Any:
        calls.append("save")
        return index_select(*args, **kwargs)

    def copy(self: torch.Tensor, *args: Any) -> Any:
        calls.append("load")
        return index_copy_(self, *args)

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(torch, "index_select", select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", copy)
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(64, 1 << 12, generator=gen)  # 16 KiB rows: PARALLEL_ELEMS is 32 of them
    pool = torch.zeros(2, 96, 1 << 12)
    copier = BlockCopier(wide_rows(pool, 2))
    device = torch.randperm(64, generator=gen)[:40].tolist()
    host = [*range(36), *range(50, 54)]  # a run of 36 rows (torch's, with threads) and one of 4 (numpy's)
    plan = CopyPlan.build(device, host)
    assert -(-PARALLEL_ELEMS // wide_rows(kv).shape[1]) == 32
    copier.save(1, wide_rows(kv), plan)
    assert torch.equal(pool[1, host], kv[device]) and not pool[0].any()
    back = torch.zeros_like(kv)
    copier.load(1, wide_rows(back), plan)
    assert torch.equal(back[device], kv[device]) and not back[[i for i in range(64) if i not in device]].any()
    assert calls == (["save", "load"] if threads > 1 else [])


def test_path_chooser_takes_the_lower_mean_and_tries_the_other_path_as_rarely_as_it_is_slow() -> None:
    paths = PathChooser(explore_every=4, weight=0.5)
    assert paths.pick() is True  # no mean yet: torch's threads first, then numpy's thread
    paths.record(True, 3.0, 1)  # seconds a byte, in exact binary fractions
    assert paths.pick() is False
    paths.record(False, 1.0, 1)
    picks = [paths.pick() for _ in range(24)]  # torch's threads 3x slower: tried once every 4 * 3 copies
    assert [i for i, threads in enumerate(picks) if threads] == [11, 23]
    paths.record(True, 0.0, 1)  # torch's threads now free: their mean halves towards 0 ...
    assert paths.seconds_per_byte == {True: 1.5, False: 1.0}
    paths.record(True, 0.0, 1)  # ... and goes under numpy's mean: it takes over, numpy's tried every 4 / 0.75
    picks = [paths.pick() for _ in range(12)]
    assert [i for i, threads in enumerate(picks) if not threads] == [5, 11]


def test_long_runs_take_numpy_when_torchs_threads_have_been_slower(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run goes where copies have been faster per byte in this process (stalled threads included)."""
    calls: list[str] = []
    index_select, index_copy_ = torch.index_select, torch.Tensor.index_copy_
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: calls.append("save") or index_select(*a, **k))
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: calls.append("load") or index_copy_(self, *a))
    gen = torch.Generator().manual_seed(11)
    kv = torch.randn(64, 1 << 12, generator=gen)  # 16 KiB rows: a run of 32 or more is long
    pool = torch.zeros(2, 96, 1 << 12)
    copier = BlockCopier(wide_rows(pool, 2))
    for paths in copier.paths.values():
        paths.seconds_per_byte.update({True: 1.0, False: 1e-12})  # torch's threads: a second a byte so far
    device = torch.randperm(64, generator=gen)[:40].tolist()
    plan = CopyPlan.build(device, list(range(40)))  # one run of 40 rows
    copier.save(0, wide_rows(kv), plan)
    back = torch.zeros_like(kv)
    copier.load(0, wide_rows(back), plan)
    assert torch.equal(pool[0, :40], kv[device]) and torch.equal(back[device], kv[device]) and calls == []
    for paths in copier.paths.values():  # each direction timed its copy of 40 rows on numpy's path
        assert 1e-12 < paths.seconds_per_byte[False] < 1.0 and paths.seconds_per_byte[True] == 1.0


NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); scripts/gpu-check.sh runs it on a GPU machine"
SLOW_KERNEL = 50_000_000  # GPU cycles (tens of ms): a copy not ordered after it would see the old bytes


def _cuda_worker() -> tuple[Any, dict[str, torch.Tensor]]:
    worker = load_connector("offload", role="worker", config={"pool_blocks": 4}).side
    kv = {f"layer.{i}": torch.zeros(8, 2, 16, 2, 8, dtype=torch.float16, device="cuda") for i in range(2)}
    worker.register_kv_caches(kv)
    assert worker.pinned and worker.pool.is_pinned() and worker._stream is not None
    return worker, kv


def _until_received(worker: Any, req_id: str) -> None:
    for _ in range(10_000):
        if req_id in worker.get_finished()[1]:
            return
        torch.cuda.synchronize()
    raise AssertionError(f"load of {req_id} never reported finished")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_saves_run_after_the_layer_compute_and_loads_land_before_they_are_reported() -> None:
    worker, kv = _cuda_worker()
    values = {name: torch.randn(2, 2, 16, 2, 8, device="cuda").half() for name in kv}
    worker.start_load_kv(OffloadMetadata(store_seq=1, stores=[_transfer("a", [1, 2], [0, 1])]))
    for name, t in kv.items():
        torch.cuda._sleep(SLOW_KERNEL)  # the layer's compute is slow...
        t[1:3] = values[name]  # ...and writes the blocks just before the save is issued
        worker.save_kv_layer(name)
    worker.wait_for_save()
    torch.cuda.synchronize()
    worker.get_finished()
    assert worker.get_kv_connector_stats()["blocks_saved"] == 2
    worker.start_load_kv(OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])]))
    _until_received(worker, "b")
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(kv[name][5:7], values[name]) for name in kv)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_next_step_compute_waits_for_the_running_store() -> None:
    worker, kv = _cuda_worker()
    values = {name: torch.randn(2, 2, 16, 2, 8, device="cuda").half() for name in kv}
    for name, t in kv.items():
        t[1:3] = values[name]
    worker.start_load_kv(OffloadMetadata(store_seq=1, stores=[_transfer("a", [1, 2], [0, 1])]))
    with torch.cuda.stream(worker._stream):
        torch.cuda._sleep(SLOW_KERNEL)  # the store's copies start late
    for name in kv:
        worker.save_kv_layer(name)
    worker.wait_for_save()
    worker.start_load_kv(OffloadMetadata())  # next step: its compute must not overwrite blocks still being read
    for t in kv.values():
        t[1:3] = 0  # e.g. blocks freed and reused by the next step's compute
    torch.cuda.synchronize()
    worker.get_finished()
    worker.start_load_kv(OffloadMetadata(loads=[_transfer("b", [5, 6], [0, 1])]))
    _until_received(worker, "b")
    assert all(torch.equal(kv[name][5:7], values[name]) for name in kv)
