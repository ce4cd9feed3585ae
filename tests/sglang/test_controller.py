"""SGLang's HiCacheController backs pages up to a kvconn store and prefetches them back, on its own threads.

Real page keys (SGLang's SHA-256 chains over token ids), real host pools, the
controller's backup thread (``write_storage`` -> ``batch_set_v1``), prefetch
thread (``batch_exists``) and I/O thread (``batch_get_v1``).
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import torch

from kvconn.store import HEADER_BYTES
from kvconn_sglang.testing.rig import PAGE, Controller, extra, page, same_pages


def _tokens(n_pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_pages * PAGE))


@pytest.mark.parametrize(
    ("kind", "layout"), [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first_direct")]
)
def test_backup_then_prefetch_lands_the_same_bytes(store: tuple[str, dict[str, Any]], kind: str, layout: str) -> None:
    ctl = Controller.over(extra(*store), kind, layout, seed=1)
    host = ctl.host
    tokens = _tokens(6)
    saved = host.alloc(len(tokens))
    assert ctl.backup(tokens, saved) == len(tokens)
    got = ctl.prefetch(tokens + _tokens(2, start=5000))  # two more pages nobody stored
    assert (got.hit_tokens, got.loaded_tokens) == (len(tokens), len(tokens))
    assert same_pages(host, saved, got.host_indices, 6) is None
    ctl.close()


def test_a_partial_hit_prefetches_the_stored_prefix(store: tuple[str, dict[str, Any]]) -> None:
    ctl = Controller.over(extra(*store), seed=2)
    tokens = _tokens(5)
    saved = ctl.host.alloc(3 * PAGE)
    assert ctl.backup(tokens[: 3 * PAGE], saved) == 3 * PAGE
    got = ctl.prefetch(tokens)
    assert (got.hit_tokens, got.loaded_tokens) == (3 * PAGE, 3 * PAGE)
    assert same_pages(ctl.host, saved, got.host_indices, 3) is None
    ctl.close()


def test_a_corrupt_value_stops_the_prefetch_before_it(store: tuple[str, dict[str, Any]]) -> None:
    ctl = Controller.over(extra(*store), "mha", "page_head", seed=4)
    host = ctl.host
    tokens = _tokens(5)
    tier = ctl.backend.tier
    bad = tier.key(ctl.hashes(tokens)[2])
    junk = b"\x5a" * (HEADER_BYTES + tier.views.page_bytes)  # right length, not a value kvconn sealed
    assert list(tier.guard.call("put", lambda s: s.put([bad], [junk]))) == [True]
    saved = host.alloc(len(tokens))
    ctl.backup(tokens, saved)
    got = ctl.prefetch(tokens)
    assert got.hit_tokens == len(tokens)  # every key exists ...
    assert got.loaded_tokens == 2 * PAGE  # ... but the prefetch stops before the page that fails
    assert same_pages(host, saved, got.host_indices, 2) is None
    assert not page(host, got.host_indices, 2).view(torch.uint8).eq(0x5A).all()  # the foreign bytes stayed out
    assert ctl.backend.get_stats()["load_failed_integrity_foreign"] == 1
    ctl.close()


def test_a_hung_store_costs_the_deadline_not_the_prefetch_thread(redis_server: Any, namespace: str) -> None:
    config = {"namespace": namespace, "url": redis_server.url, "timeout_s": 0.5, "socket_timeout_s": 30.0}
    ctl = Controller.over(extra("redis", config), seed=6)
    host = ctl.host
    tokens = _tokens(4)
    assert ctl.backup(tokens, host.alloc(len(tokens))) == len(tokens)
    redis_server.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        got = ctl.prefetch(tokens)
        took = time.monotonic() - start
        assert got.hit_tokens == 0
        assert took < 0.5 + 2.0, f"the prefetch waited {took:.1f} s on a hung store"
        start = time.monotonic()
        assert ctl.backup(_tokens(2, start=7000), host.alloc(2 * PAGE)) == 0  # skipped, the store is off
        assert time.monotonic() - start < 2.0
        # The controller's threads still run: a later prefetch is answered too.
        assert ctl.prefetch(tokens).hit_tokens == 0
    finally:
        redis_server.signal(signal.SIGCONT)
    stats = ctl.backend.get_stats()
    assert stats["lookup_failed_store_off"] >= 1 and stats["save_failed_store_off"] == 2
    ctl.close()


def test_a_dead_store_means_misses_and_skipped_backups(redis_server: Any, namespace: str) -> None:
    config = {"namespace": namespace, "url": redis_server.url, "timeout_s": 1.0, "socket_timeout_s": 0.5}
    ctl = Controller.over(extra("redis", config), "mla", "page_first")
    host = ctl.host
    tokens = _tokens(3)
    redis_server.stop()
    assert ctl.backup(tokens, host.alloc(len(tokens))) == 0
    assert ctl.prefetch(tokens).hit_tokens == 0
    assert ctl.prefetch(tokens).hit_tokens == 0  # the prefetch thread lives on
    stats = ctl.backend.get_stats()
    assert stats["save_failed_store_off"] == 3
    assert stats["lookup_failed_store_off"] >= 1
    ctl.close()


def test_deployments_of_other_models_never_read_each_others_pages(store: tuple[str, dict[str, Any]]) -> None:
    first = Controller.over(extra(*store), model="org/model-a", seed=8)
    tokens = _tokens(3)
    assert first.backup(tokens, first.host.alloc(len(tokens))) == len(tokens)
    first.close()
    for model, hit in (("org/model-b", 0), ("org/model-a", len(tokens))):  # the same deployment does share
        reader = Controller.over(extra(*store), model=model)
        assert reader.prefetch(tokens).hit_tokens == hit, model
        reader.close()


def test_the_generic_calls_serve_a_controller_without_interface_v1(store: tuple[str, dict[str, Any]]) -> None:
    config = {**extra(*store), "interface_v1": 0}  # SGLang's copying page_get / page_set path
    ctl = Controller.over(config, "mha", "layer_first", seed=12)
    assert ctl.cc.page_get_func == ctl.cc._generic_page_get
    tokens = _tokens(3, start=3000)
    saved = ctl.host.alloc(len(tokens))
    assert ctl.backup(tokens, saved) == len(tokens)
    got = ctl.prefetch(tokens)
    assert got.loaded_tokens == len(tokens)
    assert same_pages(ctl.host, saved, got.host_indices, 3) is None
    ctl.close()


@pytest.mark.parametrize("fault", ["hang", "down"])
def test_the_embedded_store_hung_or_down_costs_a_deadline_and_counts(namespace: str, fault: str) -> None:
    from kvconn_mooncake import MooncakeConnector
    from kvconn_sglang.testing.faults import FaultyStore, faulty_class

    ctl = Controller.over(extra("mooncake", {"namespace": namespace, "timeout_s": 0.5}), seed=14)
    stores: list[FaultyStore] = []
    ctl.swap_store_class(faulty_class(MooncakeConnector, stores))
    tokens = _tokens(3, start=4000)
    assert ctl.backup(tokens, ctl.host.alloc(len(tokens))) == len(tokens)
    stores[-1].mode = fault
    start = time.monotonic()
    assert ctl.prefetch(tokens).hit_tokens == 0
    assert ctl.backup(_tokens(2, start=4500), ctl.host.alloc(2 * PAGE)) == 0
    assert time.monotonic() - start < 0.5 + 2.0
    stores[-1].released.set()
    stats = ctl.backend.get_stats()
    assert stats["lookup_failed_store_off"] >= 1 and stats["save_failed_store_off"] == 2
    ctl.close()
