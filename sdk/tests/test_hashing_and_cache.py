"""Chained block hashes and the KV-cache manager's bookkeeping."""

from __future__ import annotations

from kvconn import KVCacheGroupSpec
from kvconn.hashing import ROOT_HASH, hash_block, hash_blocks, namespace_key
from kvconn.reference import KVCacheManager, Request


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    a = hash_blocks(list(range(40)), 16)
    b = hash_blocks([99, *range(1, 40)], 16)
    assert len(a) == 2  # only full blocks
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert a[0] == hash_block(ROOT_HASH, list(range(16)))
    assert hash_blocks(list(range(40)), 16, parent=a[0], start=16) == a[1:]
    assert hash_blocks(list(range(32)), 16, extra_keys=("lora-1",)) != a


def test_request_hashes_grow_as_blocks_fill() -> None:
    request = Request("r", list(range(31)), max_tokens=4, block_size=16)
    assert len(request.block_hashes) == 1
    request.append_output_token(31)
    assert request.block_hashes == hash_blocks(list(range(32)), 16)


def test_namespace_keys_differ_when_any_part_differs() -> None:
    base = namespace_key("model", "float16", "NHD", 16, 0, 0)
    assert base == namespace_key("model", "float16", "NHD", 16, 0, 0)
    assert (
        len(
            {
                base,
                namespace_key("model", "bfloat16", "NHD", 16, 0, 0),
                namespace_key("model", "float16", "NHD", 16, 1, 0),
            }
        )
        == 3
    )


def test_ref_counts_prefix_hits_and_eviction() -> None:
    kv = KVCacheManager([KVCacheGroupSpec(("l",))], num_blocks=5, block_size=4)
    a = Request("a", list(range(10)), 1, 4)
    assert kv.get_computed_blocks(a) == ([[]], 0)
    assert kv.allocate_slots(a, 10, num_computed_tokens=0) == ([1, 2, 3],)
    kv.cache_blocks(a, 10)
    b = Request("b", list(range(9)), 1, 4)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 8 and [x.block_id for x in blocks[0]] == [1, 2]
    assert kv.allocate_slots(b, 9, num_computed_tokens=8, computed_blocks=blocks) == ([4],)
    assert [x.ref_cnt for x in kv.pool.blocks[1:]] == [2, 2, 1, 1]
    assert kv.allocate_slots(Request("c", [7] * 8, 1, 4), 8, num_computed_tokens=0) is None  # no room
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 4
    c = Request("c", [7] * 16, 1, 4)
    assert kv.allocate_slots(c, 16, num_computed_tokens=0) is not None  # evicts the cached blocks
    assert kv.get_computed_blocks(Request("d", list(range(9)), 1, 4))[1] == 0


def test_sliding_window_tables_use_the_null_block_outside_the_window() -> None:
    groups = [KVCacheGroupSpec(("f",)), KVCacheGroupSpec(("s",), sliding_window=8)]
    kv = KVCacheManager(groups, num_blocks=20, block_size=4)
    r = Request("r", list(range(20)), 1, 4)
    kv.allocate_slots(r, 20, num_computed_tokens=0)
    r.num_computed_tokens = 20
    kv.remove_skipped_blocks(r)
    full, window = kv.get_block_ids("r")
    assert 0 not in full
    assert window[:3] == [0, 0, 0] and 0 not in window[3:]  # tokens 13..19 are in the window of token 20
