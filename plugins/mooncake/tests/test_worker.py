"""The worker side's batched data path, block by block, on the embedded store.

The hot path checks block ids, drops repeated keys and counts results per
KV-cache group rather than per block; these tests pin the per-block outcome
of every mix the fast paths must get right: two groups of different block
sizes, repeated keys, unaddressable ids, missing keys, values of another size
and keys already stored.
"""

from __future__ import annotations

import ctypes
import uuid

import pytest
import torch

from kvconn import ConnectorContext, KVCacheGroupSpec
from kvconn_mooncake import BlockTransfer, EmbeddedStore, MooncakeConfig, MooncakeMetadata, StoreLease
from kvconn_mooncake.integrity import HEADER_BYTES
from kvconn_mooncake.keys import BlockKeys
from kvconn_mooncake.worker import WorkerSide

NUM_BLOCKS = 8
GROUPS = (KVCacheGroupSpec(("full.0", "full.1")), KVCacheGroupSpec(("swa.0",), sliding_window=32))
SHAPES = {"full.0": (2, 4, 8), "full.1": (2, 4, 8), "swa.0": (2, 4, 3)}  # per block; the groups differ in size
VALUE_BYTES = (2 * 2 * 4 * 8 * 2, 2 * 4 * 3 * 2)  # fp16: group 0 (two layers), group 1 (one layer)
KEYS = BlockKeys(ConnectorContext(kv_cache_groups=GROUPS))


def _worker(store: EmbeddedStore, secret: str | None = None) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    config = MooncakeConfig(integrity_secret=secret)
    worker = WorkerSide(config, ConnectorContext(kv_cache_groups=GROUPS), StoreLease(store, "embedded"))
    kv = {name: torch.randn((NUM_BLOCKS, *shape)).half() for name, shape in SHAPES.items()}
    worker.register_kv_caches(kv)
    return worker, kv


def _layers(group: int) -> tuple[str, ...]:
    return GROUPS[group].layer_names


def _key(group: int, i: int) -> str:
    """A fresh key in the test workers' namespace for ``group`` (the one the scheduler side would name)."""
    return KEYS.key(group, uuid.uuid4().bytes + bytes([i]))


def _save(worker: WorkerSide, transfers: list[BlockTransfer]) -> dict[str, float]:
    worker.start_load_kv(MooncakeMetadata(saves=transfers))
    worker.wait_for_save()
    worker.get_finished()
    return worker.get_kv_connector_stats()


@pytest.fixture
def store() -> EmbeddedStore:
    return EmbeddedStore(1 << 30)


def test_loads_land_in_their_blocks_and_only_failed_blocks_are_reported(store: EmbeddedStore) -> None:
    writer, src = _worker(store)
    keys = {(g, i): _key(g, i) for g in (0, 1) for i in (1, 2, 3)}
    stats = _save(writer, [BlockTransfer(k, i, g) for (g, i), k in keys.items()])
    assert stats["blocks_saved"] == 6 and stats["bytes_saved"] == 3 * sum(VALUE_BYTES)

    reader, dst = _worker(store)
    loads = [
        BlockTransfer(keys[0, 1], 5, 0),
        BlockTransfer(keys[1, 2], 4, 1),
        BlockTransfer(keys[0, 1], 6, 0),  # the same key again (two requests sharing a prefix)
        BlockTransfer(keys[0, 3], 7, 0),
        BlockTransfer(keys[1, 3], 6, 1),
        BlockTransfer(keys[1, 3], 7, 1),  # a repeat in the second group
        BlockTransfer("missing-key", 2, 0),
        BlockTransfer(keys[0, 2], 0, 0),  # the null block: never written
        BlockTransfer(keys[0, 2], NUM_BLOCKS, 0),  # out of range
        BlockTransfer(keys[0, 2], 3, 2),  # no such group
    ]
    reader.start_load_kv(MooncakeMetadata(loads=loads))
    assert reader.get_block_ids_with_load_errors() == {2, 0, NUM_BLOCKS, 3}
    stats = reader.get_kv_connector_stats()
    assert stats["blocks_loaded"] == 6 and stats["bytes_loaded"] == 3 * sum(VALUE_BYTES)
    assert stats["load_failed_not_found"] == 1 and stats["load_failed_unaddressable"] == 3
    for (g, i), dst_block in {(0, 1): 5, (1, 2): 4, (0, 3): 7, (1, 3): 6}.items():
        assert all(torch.equal(dst[n][dst_block], src[n][i]) for n in _layers(g))
    assert all(torch.equal(dst[n][6], src[n][1]) for n in _layers(0))  # the repeat was copied locally
    assert all(torch.equal(dst[n][7], src[n][3]) for n in _layers(1))


def test_repeat_of_a_failed_key_fails_too_and_other_sizes_are_short_reads(store: EmbeddedStore) -> None:
    small = KEYS.key(0, b"small")
    value = bytearray(VALUE_BYTES[1])  # a value of a group-1 block's size, stored by another client under a group-0 key
    assert store.batch_put_from([small], [[ctypes.addressof(ctypes.c_char.from_buffer(value))]], [[len(value)]]) == [0]
    reader, _ = _worker(store)
    loads = [BlockTransfer("gone", 2, 0), BlockTransfer("gone", 3, 0), BlockTransfer(small, 4, 0)]
    reader.start_load_kv(MooncakeMetadata(loads=loads))  # ... read as a (bigger) group-0 block
    assert reader.get_block_ids_with_load_errors() == {2, 3, 4}
    stats = reader.get_kv_connector_stats()
    assert stats["load_failed_not_found"] == 2 and stats["load_failed_short_read"] == 1
    assert "blocks_loaded" not in stats


def test_saves_skip_stored_keys_and_unaddressable_blocks(store: EmbeddedStore) -> None:
    worker, kv = _worker(store)
    stored = [BlockTransfer(_key(0, 1), 1, 0), BlockTransfer(_key(1, 1), 1, 1)]
    _save(worker, stored)
    kv["full.0"][1].zero_()  # a put never overwrites: the zeroed block must not reach the store
    fresh = [BlockTransfer(_key(0, 2), 2, 0), BlockTransfer(_key(1, 3), 3, 1)]
    bad = [BlockTransfer(_key(0, 4), 0, 0), BlockTransfer(_key(1, 5), NUM_BLOCKS + 1, 1)]
    stats = _save(worker, [stored[0], fresh[0], bad[0], stored[1], fresh[1], bad[1]])
    assert stats["blocks_saved"] == 2 and stats["blocks_skipped_existing"] == 2
    assert stats["save_failed_unaddressable"] == 2 and stats["bytes_saved"] == sum(VALUE_BYTES)
    assert store.batch_is_exist([t.key for t in stored + fresh + bad]) == [1, 1, 1, 1, 0, 0]
    out = torch.empty(HEADER_BYTES + VALUE_BYTES[0], dtype=torch.uint8)
    assert store.batch_get_into([stored[0].key], [[out.data_ptr()]], [[out.numel()]]) == [out.numel()]
    assert out[HEADER_BYTES : HEADER_BYTES + VALUE_BYTES[0] // 2].any()  # block 1 of full.0 as first saved


def _put_raw(store: EmbeddedStore, values: dict[str, torch.Tensor]) -> None:
    """Another client's puts: raw bytes under keys of its choosing."""
    ptrs, sizes = [[t.data_ptr()] for t in values.values()], [[t.numel()] for t in values.values()]
    assert store.batch_put_from(list(values), ptrs, sizes) == [0] * len(values)


def _load(worker: WorkerSide, kv: dict[str, torch.Tensor], loads: list[BlockTransfer]) -> tuple[set[int], dict]:
    """Load ``loads``; check that no block reported as failed was written; the failed blocks and the stats."""
    before = {name: t.clone() for name, t in kv.items()}
    worker.start_load_kv(MooncakeMetadata(loads=loads))
    failed = worker.get_block_ids_with_load_errors()
    for t in loads:
        if t.block_id in failed:
            assert all(torch.equal(kv[n][t.block_id], before[n][t.block_id]) for n in _layers(t.group))
    return failed, worker.get_kv_connector_stats()


def test_values_failing_verification_never_reach_the_kv_cache(store: EmbeddedStore) -> None:
    """Garbage of the right size, a short value, and a valid value copied under another key: staged, refused."""
    writer, src = _worker(store)
    good = {i: _key(0, i) for i in (1, 2)}
    _save(writer, [BlockTransfer(k, i, 0) for i, k in good.items()])
    size = HEADER_BYTES + VALUE_BYTES[0]
    copied = torch.empty(size, dtype=torch.uint8)
    assert store.batch_get_into([good[1]], [[copied.data_ptr()]], [[size]]) == [size]
    garbage = torch.randint(0, 256, (size,), dtype=torch.uint8)
    poisoned = {"garbage": garbage, "short": garbage[: size // 2].clone(), "copied": copied}
    keys = {name: _key(0, 9) for name in poisoned}
    _put_raw(store, {keys[name]: value for name, value in poisoned.items()})

    reader, dst = _worker(store)
    loads = [BlockTransfer(keys["garbage"], 4, 0), BlockTransfer(keys["short"], 5, 0)]
    loads += [BlockTransfer(keys["copied"], 6, 0), BlockTransfer(good[2], 7, 0)]
    failed, stats = _load(reader, dst, loads)
    assert failed == {4, 5, 6}
    assert stats["load_failed_integrity_foreign"] == 1 and stats["load_failed_short_read"] == 1
    assert stats["load_failed_integrity_other_key"] == 1 and stats["degraded_events"] == 3
    assert stats["blocks_loaded"] == 1 and all(torch.equal(dst[n][7], src[n][2]) for n in _layers(0))


def test_damaged_payload_is_refused(store: EmbeddedStore) -> None:
    writer, _ = _worker(store)
    key = _key(0, 1)
    _save(writer, [BlockTransfer(key, 1, 0)])
    store._values[key][-1] ^= 1  # one bit of the last layer's bytes, flipped in the store
    reader, dst = _worker(store)
    failed, stats = _load(reader, dst, [BlockTransfer(key, 3, 0)])
    assert failed == {3} and stats["load_failed_integrity_checksum"] == 1


@pytest.mark.parametrize(
    ("writer_secret", "reason"),
    [(None, "load_failed_integrity_unsigned"), ("another secret, 16+", "load_failed_integrity_checksum")],
)
def test_with_a_secret_only_values_sealed_with_it_load(
    store: EmbeddedStore, writer_secret: str | None, reason: str
) -> None:
    """A writer without the shared secret cannot forge a value, though it knows the key and the format."""
    secret = "the shared secret, 16+"
    forger, _ = _worker(store, writer_secret)
    honest, src = _worker(store, secret)
    forger.keys = honest.keys  # it knows the key (the namespace of a secret is public)
    forged, sealed = _key(0, 1), _key(0, 2)
    _save(forger, [BlockTransfer(forged, 1, 0)])
    _save(honest, [BlockTransfer(sealed, 2, 0)])
    reader, dst = _worker(store, secret)
    failed, stats = _load(reader, dst, [BlockTransfer(forged, 3, 0), BlockTransfer(sealed, 4, 0)])
    assert failed == {3} and stats[reason] == 1
    assert stats["blocks_loaded"] == 1 and all(torch.equal(dst[n][4], src[n][2]) for n in _layers(0))


def test_tensor_parallel_ranks_store_and_load_their_own_shards(store: EmbeddedStore) -> None:
    """Under vLLM the scheduler names keys for TP rank 0; every rank must still keep its shard under keys of its own.

    The shards have one layout, so the header check cannot tell them apart: rank 1 would load rank 0's shard.
    """
    scheduler_keys = BlockKeys(ConnectorContext(kv_cache_groups=GROUPS, tp_size=2))
    transfers = [BlockTransfer(scheduler_keys.key(0, bytes([i]) * 32), i, 0) for i in (1, 2)]
    shards = {}
    lease = StoreLease(store, "embedded")
    for rank in (0, 1):  # each rank saves its own shard of the same blocks
        worker = WorkerSide(MooncakeConfig(), ConnectorContext(kv_cache_groups=GROUPS, tp_rank=rank, tp_size=2), lease)
        shards[rank] = {name: torch.randn((NUM_BLOCKS, *shape)).half() for name, shape in SHAPES.items()}
        worker.register_kv_caches(shards[rank])
        assert _save(worker, transfers)["blocks_saved"] == 2
    reader = WorkerSide(MooncakeConfig(), ConnectorContext(kv_cache_groups=GROUPS, tp_rank=1, tp_size=2), lease)
    kv = {name: torch.zeros((NUM_BLOCKS, *shape)).half() for name, shape in SHAPES.items()}
    reader.register_kv_caches(kv)
    reader.start_load_kv(MooncakeMetadata(loads=transfers))
    assert not reader.get_block_ids_with_load_errors()
    for name in _layers(0):
        assert torch.equal(kv[name][1:3], shards[1][name][1:3]), f"rank 1 loaded another rank's shard of {name}"
