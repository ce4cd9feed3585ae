"""kvconn.store in place: a PartsStore saves each value from its header and views of the KV caches, and a
ScatterStore's async loads read into those views (verified there, never reported before the get returned)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import ClassVar

import torch

from kvconn import ConnectorContext, KVCacheGroupSpec, KVConnectorRole
from kvconn.store import (
    HEADER_BYTES,
    BlockStore,
    Integrity,
    PartsStore,
    ScatterStore,
    StoreBlock,
    StoreConnector,
    StoreMetadata,
)
from kvconn.store.values import judge, seal_parts
from kvconn.store.worker import StoreWorker
from kvconn.testing.memory_store import MemoryStore, faults

GROUPS = (KVCacheGroupSpec(("layer.0", "layer.1")),)
SHAPE = (2, 4, 8)  # per block


class PartsMemoryStore(MemoryStore):
    """The in-memory store, writing values from parts and reading them into parts (its faults apply to both).

    ``tamper`` changes the first payload part as it is read.
    """

    tamper = False

    def put_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        self.calls.append("put_parts")
        values = []
        for value in parts:
            if self.tamper:  # the engine writes the block while a put past its deadline still reads it
                value[1][0] ^= 0xFF
            values.append(b"".join(value))
        return MemoryStore.put(self, keys, values)

    def put(self, keys: Sequence[bytes], values: Sequence[bytes | memoryview]) -> list[bool]:
        self.calls.append("put")
        return super().put(keys, values)

    def get_parts(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[int | None]:
        self.calls.append("get_parts")
        wholes = [bytearray(sum(part.nbytes for part in value)) for value in parts]
        lengths = MemoryStore.get(self, keys, [memoryview(whole) for whole in wholes])
        for whole, value, length in zip(wholes, parts, lengths, strict=True):
            offset = 0
            for part in value if length == len(whole) else ():
                part[:] = whole[offset : offset + part.nbytes]
                offset += part.nbytes
        return lengths

    @property
    def calls(self) -> list[str]:
        return self.__dict__.setdefault("_calls", [])


class PartsConnector(StoreConnector):
    stores: ClassVar[dict[str, PartsMemoryStore]] = {}

    def open_store(self) -> BlockStore:
        return self.stores.setdefault(self.config.namespace, PartsMemoryStore(self.config.namespace))


def _worker(namespace: str, timeout_s: float = 2.0) -> tuple[StoreWorker, dict[str, torch.Tensor]]:
    config = PartsConnector.Config(namespace=namespace, timeout_s=timeout_s)
    side = PartsConnector(config, role=KVConnectorRole.WORKER, context=ConnectorContext(kv_cache_groups=GROUPS)).side
    assert isinstance(side, StoreWorker)
    kv = {name: torch.randn((8, *SHAPE)).half() for name in GROUPS[0].layer_names}
    side.register_kv_caches(kv)
    side.guard.call("open", lambda store: store.contains([]))  # opened: the worker now knows what it can do
    return side, kv


def _save(worker: StoreWorker, blocks: list[StoreBlock]) -> dict[str, float]:
    worker.start_load_kv(StoreMetadata(saves=blocks, load_async=False))
    worker.wait_for_save()
    return worker.get_kv_connector_stats()


def test_seal_of_parts_equals_seal_of_the_whole() -> None:
    payload = bytes(range(256)) * 4
    views = [memoryview(payload)[:100], memoryview(payload)[100:]]
    for secret in (None, "a shared secret, 16+"):
        integrity = Integrity(secret)
        assert integrity.seal(b"k", bytes(8), views) == integrity.seal(b"k", bytes(8), memoryview(payload))


def test_a_payload_size_the_caller_knows_seals_and_judges_as_the_sum_of_the_parts() -> None:
    """``payload_bytes`` (a page's or block's size, given to skip summing its parts) changes no header and no
    verdict; a size that disagrees with the value read never lets it load."""
    payload = bytes(range(256)) * 4
    views = [memoryview(payload)[:100], memoryview(payload)[100:]]
    size = len(payload)
    for secret in (None, "a shared secret, 16+"):
        integrity = Integrity(secret)
        assert integrity.seal(b"k", bytes(8), views, size) == integrity.seal(b"k", bytes(8), views)
        sealed = seal_parts(integrity, [b"k", b"j"], bytes(8), [views, views], size)
        assert [bytes(parts[0]) for parts in sealed] == [
            bytes(parts[0]) for parts in seal_parts(integrity, [b"k", b"j"], bytes(8), [views, views])
        ]
        header = sealed[0][0]
        assert judge(integrity, b"k", bytes(8), HEADER_BYTES + size, header, views, size) is None
        assert judge(integrity, b"k", bytes(8), HEADER_BYTES + size - 1, header, views, size - 1) == "integrity_short"
        assert judge(integrity, b"k", bytes(8), HEADER_BYTES + size, header, views, size - 1) == "integrity_short"
        damaged = bytearray(payload)
        damaged[-1] ^= 1
        parts = [memoryview(damaged)[:100], memoryview(damaged)[100:]]
        assert judge(integrity, b"k", bytes(8), HEADER_BYTES + size, header, parts, size) == "integrity_checksum"


def test_saves_read_host_kv_caches_in_place_and_load_exactly() -> None:
    namespace = uuid.uuid4().hex
    writer, src = _worker(namespace)
    store = PartsConnector.stores[namespace]
    assert isinstance(store, PartsStore)
    blocks = [StoreBlock("a", 0, i, bytes([i]) * 32) for i in (1, 2, 3)]
    assert _save(writer, blocks)["blocks_saved"] == 3 and store.calls == ["put_parts"]
    reader, dst = _worker(namespace)
    loads = [StoreBlock("b", 0, 4 + i, b.block_hash) for i, b in enumerate(blocks)]
    reader.start_load_kv(StoreMetadata(loads=loads, load_async=False))
    assert reader.get_block_ids_with_load_errors() == set()
    for name in GROUPS[0].layer_names:
        assert torch.equal(dst[name][4:7], src[name][1:4])


def test_a_block_changed_under_a_late_put_never_loads() -> None:
    """The tag is taken before the put: bytes that changed while the store read them fail verification."""
    namespace = uuid.uuid4().hex
    writer, _ = _worker(namespace)
    PartsConnector.stores[namespace].tamper = True
    assert _save(writer, [StoreBlock("a", 0, 1, bytes(32))])["blocks_saved"] == 1
    reader, dst = _worker(namespace)
    before = {name: t.clone() for name, t in dst.items()}
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("b", 0, 5, bytes(32))], load_async=False))
    assert reader.get_block_ids_with_load_errors() == {5}
    assert reader.get_kv_connector_stats()["load_failed_integrity_checksum"] == 1
    assert all(torch.equal(dst[name], before[name]) for name in dst)  # nothing of it reached the KV cache


def _recving(worker: StoreWorker, until: float) -> set[str]:
    """What ``get_finished`` reports loaded, polled until it reports something or ``until`` (monotonic) passes."""
    while not (recving := worker.get_finished(set())[1]) and time.monotonic() < until:
        time.sleep(0.005)
    return recving


def test_async_loads_read_in_place_and_a_value_failing_verification_is_reported_with_its_request() -> None:
    namespace = uuid.uuid4().hex
    writer, src = _worker(namespace)
    store = PartsConnector.stores[namespace]
    assert isinstance(store, ScatterStore)
    blocks = [StoreBlock("a", 0, i, bytes([i]) * 32) for i in (1, 2)]
    _save(writer, blocks)
    reader, dst = _worker(namespace)
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("b", 0, 4, blocks[0].block_hash)]))
    assert _recving(reader, time.monotonic() + 10) == {"b"} and reader.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(dst[name][4], src[name][1]) for name in dst) and store.calls[-1] == "get_parts"
    faults(namespace).corrupt = True  # the last byte of every value read is flipped
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("c", 0, 5, blocks[1].block_hash)]))
    assert _recving(reader, time.monotonic() + 10) == {"c"}
    assert reader.get_block_ids_with_load_errors() == {5}  # in the same report: the engine never uses block 5
    assert reader.get_kv_connector_stats()["load_failed_integrity_checksum"] == 1


def test_an_in_place_get_past_its_deadline_keeps_its_request_waiting_until_it_returns() -> None:
    """Reported before the late get returned, its request's blocks could be recomputed or reused, then overwritten."""
    namespace = uuid.uuid4().hex
    writer, src = _worker(namespace)
    block = StoreBlock("a", 0, 1, bytes(32))
    _save(writer, [block])
    reader, dst = _worker(namespace, timeout_s=0.2)
    faults(namespace).running.clear()  # every store call blocks
    reader.start_load_kv(StoreMetadata(loads=[StoreBlock("b", 0, 6, block.block_hash)]))
    assert _recving(reader, time.monotonic() + 1.0) == set()  # past its deadline: tripped, still waiting
    assert not reader.guard.available and reader.get_num_tracked_requests() == 1
    faults(namespace).running.set()  # the late get returns (and writes the block)
    assert _recving(reader, time.monotonic() + 10) == {"b"}
    assert reader.get_block_ids_with_load_errors() == set()  # it was verified: the request keeps what it loaded
    assert all(torch.equal(dst[name][6], src[name][1]) for name in dst)
