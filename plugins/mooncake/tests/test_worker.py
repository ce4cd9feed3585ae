"""The store connector's data path over the embedded Mooncake store, block by block.

The worker side batches a step into one get and one put; these tests pin the
per-block outcome of every mix that must come out right: two groups of
different block sizes, repeated keys, unaddressable ids, missing keys, values
of another size, keys already stored, values that fail verification, and
tensor-parallel shards.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kvconn import ConnectorContext, KVCacheGroupSpec, KVConnectorRole
from kvconn.store import HEADER_BYTES, StoreBlock, StoreMetadata
from kvconn.store.worker import StoreWorker
from kvconn_mooncake import EmbeddedStore, MooncakeConnector, embedded_store

NUM_BLOCKS = 8
GROUPS = (KVCacheGroupSpec(("full.0", "full.1")), KVCacheGroupSpec(("swa.0",), sliding_window=32))
SHAPES = {"full.0": (2, 4, 8), "full.1": (2, 4, 8), "swa.0": (2, 4, 3)}  # per block; the groups differ in size
VALUE_BYTES = (2 * 2 * 4 * 8 * 2, 2 * 4 * 3 * 2)  # fp16: group 0 (two layers), group 1 (one layer)


def _worker(name: str, secret: str | None = None, **context: int) -> StoreWorker:
    """A worker whose puts run in ``wait_for_save`` (its counters are read right after; ``save_async``, Mooncake's
    default, is sdk/tests/test_store_saves_async.py's and the conformance suite's)."""
    config = MooncakeConnector.Config(
        backend="embedded", embedded_store=name, integrity_secret=secret, save_async=False
    )
    ctx = ConnectorContext(kv_cache_groups=GROUPS, **context)
    worker = MooncakeConnector(config, role=KVConnectorRole.WORKER, context=ctx).side
    assert isinstance(worker, StoreWorker)
    return worker


def _caches(worker: StoreWorker, zeros: bool = False) -> dict[str, torch.Tensor]:
    make = torch.zeros if zeros else torch.randn
    kv = {name: make((NUM_BLOCKS, *shape)).half() for name, shape in SHAPES.items()}
    worker.register_kv_caches(kv)
    return kv


def _hash(i: int) -> bytes:
    return uuid.uuid4().bytes + bytes([i])


def _name(worker: StoreWorker, group: int, block_hash: bytes) -> str:
    """The Mooncake key the worker stores ``block_hash`` of ``group`` under."""
    return worker.keys.key(group, block_hash).hex()


def _save(worker: StoreWorker, blocks: list[StoreBlock]) -> dict[str, float]:
    worker.start_load_kv(StoreMetadata(saves=blocks, load_async=False))
    worker.wait_for_save()
    worker.get_finished(set())
    return worker.get_kv_connector_stats()


@pytest.fixture
def name() -> str:
    return f"test-worker-{uuid.uuid4().hex}"


@pytest.fixture
def store(name: str) -> EmbeddedStore:
    return embedded_store(name, 1 << 30)


def _layers(group: int) -> tuple[str, ...]:
    return GROUPS[group].layer_names


def test_loads_land_in_their_blocks_and_only_failed_blocks_are_reported(name: str) -> None:
    writer = _worker(name)
    src = _caches(writer)
    hashes = {(g, i): _hash(i) for g in (0, 1) for i in (1, 2, 3)}
    stats = _save(writer, [StoreBlock("w", g, i, h) for (g, i), h in hashes.items()])
    assert stats["blocks_saved"] == 6 and stats["bytes_saved"] == 3 * sum(VALUE_BYTES)

    reader = _worker(name)
    dst = _caches(reader)
    loads = [
        StoreBlock("a", 0, 5, hashes[0, 1]),
        StoreBlock("a", 1, 4, hashes[1, 2]),
        StoreBlock("b", 0, 6, hashes[0, 1]),  # the same key again (two requests sharing a prefix)
        StoreBlock("a", 0, 7, hashes[0, 3]),
        StoreBlock("a", 1, 6, hashes[1, 3]),
        StoreBlock("b", 1, 7, hashes[1, 3]),  # a repeat in the second group
        StoreBlock("a", 0, 2, b"missing"),
        StoreBlock("a", 0, 0, hashes[0, 2]),  # the null block: never written
        StoreBlock("a", 0, NUM_BLOCKS, hashes[0, 2]),  # out of range
        StoreBlock("a", 2, 3, hashes[0, 2]),  # no such group
    ]
    reader.start_load_kv(StoreMetadata(loads=loads, load_async=False))
    assert reader.get_block_ids_with_load_errors() == {2, 0, NUM_BLOCKS, 3}
    stats = reader.get_kv_connector_stats()
    assert stats["blocks_loaded"] == 6 and stats["bytes_loaded"] == 3 * sum(VALUE_BYTES)
    assert stats["load_failed_missing"] == 1 and stats["load_failed_unaddressable"] == 3
    for (g, i), dst_block in {(0, 1): 5, (1, 2): 4, (0, 3): 7, (1, 3): 6}.items():
        assert all(torch.equal(dst[n][dst_block], src[n][i]) for n in _layers(g))
    assert all(torch.equal(dst[n][6], src[n][1]) for n in _layers(0))  # the repeat was copied locally
    assert all(torch.equal(dst[n][7], src[n][3]) for n in _layers(1))


def _put_raw(store: EmbeddedStore, values: dict[str, torch.Tensor]) -> None:
    """Another client's puts: raw bytes under keys of its choosing."""
    ptrs, sizes = [t.data_ptr() for t in values.values()], [t.numel() for t in values.values()]
    assert store.batch_put_from(list(values), ptrs, sizes) == [0] * len(values)


def test_repeat_of_a_failed_key_fails_too_and_other_sizes_are_short_reads(name: str, store: EmbeddedStore) -> None:
    reader = _worker(name)
    _caches(reader)
    small = _hash(0)
    # a value of a group-1 block's size, stored by another client under a group-0 key, read as a group-0 block
    _put_raw(store, {_name(reader, 0, small): torch.zeros(VALUE_BYTES[1], dtype=torch.uint8)})
    loads = [StoreBlock("a", 0, 2, b"gone"), StoreBlock("b", 0, 3, b"gone"), StoreBlock("a", 0, 4, small)]
    reader.start_load_kv(StoreMetadata(loads=loads, load_async=False))
    assert reader.get_block_ids_with_load_errors() == {2, 3, 4}
    stats = reader.get_kv_connector_stats()
    assert stats["load_failed_missing"] == 2 and stats["load_failed_integrity_short"] == 1
    assert "blocks_loaded" not in stats


def test_a_value_longer_than_a_block_is_a_short_read_not_a_miss(name: str, store: EmbeddedStore) -> None:
    """Mooncake refuses a get into a buffer smaller than the value (INVALID_PARAMS): the store still answers its
    length, so the connector tells a foreign value from a missing one."""
    reader = _worker(name)
    _caches(reader)
    big = _hash(0)
    _put_raw(store, {_name(reader, 1, big): torch.ones(HEADER_BYTES + VALUE_BYTES[0], dtype=torch.uint8)})
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("a", 1, 2, big)], load_async=False))
    assert reader.get_block_ids_with_load_errors() == {2}
    assert reader.get_kv_connector_stats()["load_failed_integrity_short"] == 1


def test_saves_keep_stored_keys_and_skip_unaddressable_blocks(name: str, store: EmbeddedStore) -> None:
    worker = _worker(name)
    kv = _caches(worker)
    stored = [StoreBlock("a", 0, 1, _hash(1)), StoreBlock("a", 1, 1, _hash(1))]
    _save(worker, stored)
    kv["full.0"][1].zero_()  # a put never overwrites: the zeroed block must not reach the store
    fresh = [StoreBlock("a", 0, 2, _hash(2)), StoreBlock("a", 1, 3, _hash(3))]
    bad = [StoreBlock("a", 0, 0, _hash(4)), StoreBlock("a", 1, NUM_BLOCKS + 1, _hash(5))]
    stats = _save(worker, [stored[0], fresh[0], bad[0], stored[1], fresh[1], bad[1]])
    assert stats["blocks_saved"] == 4 and stats["save_failed_unaddressable"] == 2
    names = [_name(worker, b.group, b.block_hash) for b in stored + fresh + bad]
    assert store.batch_is_exist(names) == [1, 1, 1, 1, 0, 0]
    out = torch.empty(HEADER_BYTES + VALUE_BYTES[0], dtype=torch.uint8)
    assert store.batch_get_into(names[:1], [out.data_ptr()], [out.numel()]) == [out.numel()]
    assert out[HEADER_BYTES : HEADER_BYTES + VALUE_BYTES[0] // 2].any()  # block 1 of full.0 as first saved


def _load(worker: StoreWorker, kv: dict[str, torch.Tensor], loads: list[StoreBlock]) -> tuple[set[int], dict]:
    """Load ``loads``; check that no block reported as failed was written; the failed blocks and the stats."""
    before = {name: t.clone() for name, t in kv.items()}
    worker.start_load_kv(StoreMetadata(loads=loads, load_async=False))
    failed = worker.get_block_ids_with_load_errors()
    for t in loads:
        if t.block_id in failed:
            assert all(torch.equal(kv[n][t.block_id], before[n][t.block_id]) for n in _layers(t.group))
    return failed, worker.get_kv_connector_stats()


def test_values_failing_verification_never_reach_the_kv_cache(name: str, store: EmbeddedStore) -> None:
    """Garbage of the right size, a short value, and a valid value copied under another key: staged, refused."""
    writer = _worker(name)
    src = _caches(writer)
    good = {i: _hash(i) for i in (1, 2)}
    _save(writer, [StoreBlock("w", 0, i, h) for i, h in good.items()])
    size = HEADER_BYTES + VALUE_BYTES[0]
    copied = torch.empty(size, dtype=torch.uint8)
    assert store.batch_get_into([_name(writer, 0, good[1])], [copied.data_ptr()], [size]) == [size]
    garbage = torch.randint(0, 256, (size,), dtype=torch.uint8)
    poisoned = {"garbage": garbage, "short": garbage[: size // 2].clone(), "copied": copied}
    hashes = {kind: _hash(9) for kind in poisoned}
    _put_raw(store, {_name(writer, 0, hashes[kind]): value for kind, value in poisoned.items()})

    reader = _worker(name)
    dst = _caches(reader)
    loads = [StoreBlock("a", 0, 4, hashes["garbage"]), StoreBlock("a", 0, 5, hashes["short"])]
    loads += [StoreBlock("a", 0, 6, hashes["copied"]), StoreBlock("a", 0, 7, good[2])]
    failed, stats = _load(reader, dst, loads)
    assert failed == {4, 5, 6}
    assert stats["load_failed_integrity_foreign"] == 1 and stats["load_failed_integrity_short"] == 1
    assert stats["load_failed_integrity_other_key"] == 1 and stats["degraded_events"] == 3
    assert stats["blocks_loaded"] == 1 and all(torch.equal(dst[n][7], src[n][2]) for n in _layers(0))


def test_damaged_payload_is_refused(name: str, store: EmbeddedStore) -> None:
    writer = _worker(name)
    _caches(writer)
    block_hash = _hash(1)
    _save(writer, [StoreBlock("w", 0, 1, block_hash)])
    store._values[_name(writer, 0, block_hash)][-1] ^= 1  # one bit of the last layer's bytes, flipped in the store
    reader = _worker(name)
    failed, stats = _load(reader, _caches(reader), [StoreBlock("a", 0, 3, block_hash)])
    assert failed == {3} and stats["load_failed_integrity_checksum"] == 1


@pytest.mark.parametrize(
    ("writer_secret", "reason"),
    [(None, "load_failed_integrity_unsigned"), ("another secret, 16+", "load_failed_integrity_checksum")],
)
def test_with_a_secret_only_values_sealed_with_it_load(name: str, writer_secret: str | None, reason: str) -> None:
    """A writer without the shared secret cannot forge a value, though it knows the key and the format."""
    secret = "the shared secret, 16+"
    forger, honest = _worker(name, writer_secret), _worker(name, secret)
    _caches(forger)
    src = _caches(honest)
    forger.keys = honest.keys  # it knows the key (the namespace of a secret is public)
    forged, sealed = _hash(1), _hash(2)
    _save(forger, [StoreBlock("f", 0, 1, forged)])
    _save(honest, [StoreBlock("h", 0, 2, sealed)])
    reader = _worker(name, secret)
    dst = _caches(reader)
    failed, stats = _load(reader, dst, [StoreBlock("a", 0, 3, forged), StoreBlock("a", 0, 4, sealed)])
    assert failed == {3} and stats[reason] == 1
    assert stats["blocks_loaded"] == 1 and all(torch.equal(dst[n][4], src[n][2]) for n in _layers(0))


def test_tensor_parallel_ranks_store_and_load_their_own_shards(name: str) -> None:
    """Every TP rank keeps its shard under keys of its own, from the same block hashes the scheduler sends.

    The shards have one layout, so the header check cannot tell them apart: rank 1 would load rank 0's shard.
    """
    blocks = [StoreBlock("a", 0, i, bytes([i]) * 32) for i in (1, 2)]
    shards = {}
    for rank in (0, 1):  # each rank saves its own shard of the same blocks
        worker = _worker(name, tp_rank=rank, tp_size=2)
        shards[rank] = _caches(worker)
        assert _save(worker, blocks)["blocks_saved"] == 2
    reader = _worker(name, tp_rank=1, tp_size=2)
    kv = _caches(reader, zeros=True)
    reader.start_load_kv(StoreMetadata(loads=blocks, load_async=False))
    assert not reader.get_block_ids_with_load_errors()
    for layer in _layers(0):
        assert torch.equal(kv[layer][1:3], shards[1][layer][1:3]), f"rank 1 loaded another rank's shard of {layer}"


def _load_async(worker: StoreWorker, loads: list[StoreBlock]) -> tuple[set[int], dict]:
    """An async load, polled until ``get_finished`` reports it; the blocks failed by then, and the stats."""
    worker.guard.call("open", lambda store: store.contains([]))  # opened: the worker knows it can read in place
    worker.start_load_kv(StoreMetadata(loads=loads))
    deadline = time.monotonic() + 10
    while not (recving := worker.get_finished(set())[1]):
        assert time.monotonic() < deadline, "the async load was never reported"
        time.sleep(0.001)
    assert recving == {b.req_id for b in loads}
    return worker.get_block_ids_with_load_errors(), worker.get_kv_connector_stats()


def test_async_loads_read_in_place_and_report_every_bad_value_with_their_request(
    name: str, store: EmbeddedStore
) -> None:
    """Async loads skip staging (one multi-buffer get into the blocks, verified there); a bad value is reported
    failed in the same ``get_finished`` as its request, before the engine may read the block."""
    writer = _worker(name)
    src = _caches(writer)
    good = {(g, i): _hash(i) for g in (0, 1) for i in (1, 2, 3)}
    _save(writer, [StoreBlock("w", g, i, h) for (g, i), h in good.items()])
    size = HEADER_BYTES + VALUE_BYTES[0]
    garbage = torch.randint(0, 256, (size,), dtype=torch.uint8)
    copied = torch.empty(size, dtype=torch.uint8)
    assert store.batch_get_into([_name(writer, 0, good[0, 1])], [copied.data_ptr()], [size]) == [size]
    bad = {"garbage": garbage, "short": garbage[: size // 2].clone(), "long": torch.ones(size + 8, dtype=torch.uint8)}
    bad["copied"] = copied
    hashes = {kind: _hash(9) for kind in bad}
    _put_raw(store, {_name(writer, 0, hashes[kind]): value for kind, value in bad.items()})
    store._values[_name(writer, 0, good[0, 3])][-1] ^= 1  # one bit of a real value, flipped in the store

    reader = _worker(name)
    dst = _caches(reader, zeros=True)
    calls: list[str] = []
    multi = store.batch_get_into_multi_buffers
    store.batch_get_into_multi_buffers = lambda *args: calls.append("multi") or multi(*args)  # type: ignore[method-assign]
    try:
        loads = [StoreBlock("a", 0, 1 + i, h) for i, h in enumerate(hashes.values())]
        loads += [StoreBlock("b", 0, 5, good[0, 2]), StoreBlock("b", 1, 6, good[1, 1]), StoreBlock("b", 0, 6, b"gone")]
        loads += [StoreBlock("b", 0, 7, good[0, 3])]
        failed, stats = _load_async(reader, loads)
    finally:
        del store.batch_get_into_multi_buffers
    assert calls == ["multi"]  # in place: no staged get
    assert failed == {1, 2, 3, 4, 6, 7}
    assert stats["load_failed_integrity_foreign"] == 1 and stats["load_failed_integrity_short"] == 2
    assert stats["load_failed_integrity_other_key"] == 1 and stats["load_failed_integrity_checksum"] == 1
    assert stats["load_failed_missing"] == 1 and stats["blocks_loaded"] == 2
    assert all(torch.equal(dst[n][5], src[n][2]) for n in _layers(0))
    assert all(torch.equal(dst[n][6], src[n][1]) for n in _layers(1))


def test_async_loads_of_a_key_into_two_blocks_are_staged(name: str, store: EmbeddedStore) -> None:
    """Mooncake fills one destination of a key named twice in a batch: such a load is staged, copied locally."""
    writer = _worker(name)
    src = _caches(writer)
    block_hash = _hash(1)
    _save(writer, [StoreBlock("w", 0, 1, block_hash)])
    reader = _worker(name)
    dst = _caches(reader, zeros=True)
    failed, stats = _load_async(reader, [StoreBlock("a", 0, 2, block_hash), StoreBlock("b", 0, 3, block_hash)])
    assert failed == set() and stats["blocks_loaded"] == 2
    assert all(torch.equal(dst[n][b], src[n][1]) for n in _layers(0) for b in (2, 3))
