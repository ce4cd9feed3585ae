"""The embedded store keeps Mooncake's semantics (write-once, LRU eviction, codes); as a BlockStore, the contract."""

from __future__ import annotations

import pytest
import torch

from kvconn.store import BlockStore
from kvconn.testing.store_conformance import StoreConformance
from kvconn_mooncake import EmbeddedStore, MooncakeBlockStore, embedded_store
from kvconn_mooncake.codes import INVALID_PARAMS, NOT_FOUND, OK, STORE_FULL


def _buf(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


class TestEmbeddedBlockStore(StoreConformance):
    def make_store(self) -> BlockStore:
        return MooncakeBlockStore.embedded(EmbeddedStore(1 << 24))

    def make_unreachable(self, store: BlockStore) -> None:
        pytest.skip("an in-process store has no server to lose; test_real_store.py checks the real client's failures")


def _put(store: EmbeddedStore, key: str, value: torch.Tensor) -> int:
    return store.batch_put_from([key], [value.data_ptr()], [value.numel()])[0]


def _get(store: EmbeddedStore, key: str, out: torch.Tensor) -> int:
    return store.batch_get_into([key], [out.data_ptr()], [out.numel()])[0]


def test_values_round_trip() -> None:
    store = EmbeddedStore(1024)
    assert _put(store, "k", _buf([1, 2, 3, 4, 5])) == OK
    out = torch.zeros(5, dtype=torch.uint8)
    assert _get(store, "k", out) == 5 and out.tolist() == [1, 2, 3, 4, 5]
    assert store.batch_is_exist(["k", "missing"]) == [1, 0] and store.get_size("k") == 5


def test_put_is_write_once() -> None:
    store = EmbeddedStore(1024)
    assert _put(store, "k", _buf([1, 1])) == OK
    assert _put(store, "k", _buf([9, 9])) == OK  # success, but the old value stays
    out = torch.zeros(2, dtype=torch.uint8)
    assert _get(store, "k", out) == 2 and out.tolist() == [1, 1]


def test_error_codes() -> None:
    store = EmbeddedStore(4)
    assert _get(store, "nope", torch.zeros(1, dtype=torch.uint8)) == NOT_FOUND
    assert _put(store, "big", _buf([0] * 5)) == STORE_FULL
    assert _put(store, "empty", torch.zeros(0, dtype=torch.uint8)) == INVALID_PARAMS
    assert _put(store, "k", _buf([1, 2, 3])) == OK
    assert _get(store, "k", torch.zeros(2, dtype=torch.uint8)) == INVALID_PARAMS
    bigger = torch.zeros(8, dtype=torch.uint8)
    assert _get(store, "k", bigger) == 3  # a bigger destination reads the value's size, like get_into


def test_lru_eviction_keeps_recently_read() -> None:
    store = EmbeddedStore(6)
    for key in ("a", "b", "c"):
        assert _put(store, key, _buf([1, 2])) == OK
    assert _get(store, "a", torch.zeros(2, dtype=torch.uint8)) == 2  # "a" is now the most recent
    assert _put(store, "d", _buf([3, 4])) == OK
    assert store.batch_is_exist(["a", "b", "c", "d"]) == [1, 0, 1, 1]
    assert store.used_bytes == 6 and store.evictions == 1


def test_a_key_stored_again_after_its_eviction_reads_its_new_bytes() -> None:
    """Each read copies from where the key's current value lives, through single and multi-buffer gets."""
    store = EmbeddedStore(4)
    for key, value in (("k", [1, 2]), ("x", [3, 4]), ("y", [5, 6]), ("k", [7, 8])):  # "y" evicts "k", "k" then "x"
        assert _put(store, key, _buf(value)) == OK
    assert store.batch_is_exist(["k", "x", "y"]) == [1, 0, 1]
    out = torch.zeros(2, dtype=torch.uint8)
    assert _get(store, "k", out) == 2 and out.tolist() == [7, 8]
    a, b = torch.zeros(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    assert store.batch_get_into_multi_buffers(["y"], [[a.data_ptr(), b.data_ptr()]], [[1, 1]]) == [2]
    assert (a.item(), b.item()) == (5, 6)


def test_registry_shares_by_name_and_refuses_a_different_capacity() -> None:
    a = embedded_store("registry-test", 100)
    assert embedded_store("registry-test", 100) is a
    with pytest.raises(ValueError, match="already exists with capacity 100"):
        embedded_store("registry-test", 200)


def test_a_key_repeated_in_one_get_fails_after_the_first() -> None:
    """The real store fills only one destination of a repeated key: callers must not repeat keys."""
    store = EmbeddedStore(64)
    assert _put(store, "k", _buf([5, 6])) == OK
    a, b = torch.zeros(2, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8)
    codes = store.batch_get_into(["k", "k"], [a.data_ptr(), b.data_ptr()], [2, 2])
    assert codes == [2, INVALID_PARAMS] and a.tolist() == [5, 6]


def test_put_parts_takes_read_only_parts_too() -> None:
    """A read-only part (bytes) is copied for the call and kept alive through it; the value is the parts in order."""
    store = MooncakeBlockStore.embedded(EmbeddedStore(1 << 20))
    writable = memoryview(bytearray(b"abc" * 1000))
    assert store.put_parts([b"k"], [[memoryview(b"header"), writable, memoryview(b"tail" * 500)]]) == [True]
    out = bytearray(6 + 3000 + 2000)
    assert store.get([b"k"], [memoryview(out)]) == [len(out)]
    assert bytes(out) == b"header" + b"abc" * 1000 + b"tail" * 500
