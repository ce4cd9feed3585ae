"""Known bytes through SGLang's host pools, every layout, MHA and MLA: saved in place, read back exactly."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from kvconn.store import HEADER_BYTES
from kvconn.store.values import seal_parts
from kvconn_sglang.testing.rig import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    PAGE,
    extra,
    fill_known,
    make_pools,
    page,
    storage_config,
    swap_store_class,
)

LAYOUTS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", layout) for layout in MLA_LAYOUTS]


def _backend(store: tuple[str, dict[str, Any]], kind: str, layout: str, seed: int) -> tuple[Any, Any]:
    """(the tier as SGLang's factory builds it, its host pool of known bytes)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    _, host = make_pools(kind, layout)
    config = storage_config(extra(*store), mla=kind == "mla")
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    fill_known(host, seed)
    return backend, host


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_round_trip_of_known_bytes(store: tuple[str, dict[str, Any]], kind: str, layout: str) -> None:
    backend, host = _backend(store, kind, layout, seed=7)
    saved = host.alloc(4 * PAGE)
    keys = [f"{i:064x}" for i in range(4)]
    assert backend.batch_set_v1(keys, saved) == [True] * 4
    assert backend.batch_exists([*keys, f"{99:064x}"]) == 4
    loaded = host.alloc(4 * PAGE)
    for i in range(4):
        assert not torch.equal(page(host, saved, i), page(host, loaded, i))  # the test can fail
    assert backend.batch_get_v1(keys, loaded) == [True] * 4
    for i in range(4):
        assert torch.equal(page(host, saved, i), page(host, loaded, i)), f"page {i}"
    backend.close()


def test_a_partial_hit_counts_the_leading_pages(store: tuple[str, dict[str, Any]]) -> None:
    backend, host = _backend(store, "mha", "page_first", seed=3)
    keys = [f"{i:064x}" for i in range(5)]
    backend.batch_set_v1(keys[:2], host.alloc(2 * PAGE))
    backend.batch_set_v1(keys[3:], host.alloc(2 * PAGE))
    assert backend.batch_exists(keys) == 2
    results = backend.batch_get_v1(keys, host.alloc(5 * PAGE))
    assert results == [True, True, False, True, True]
    assert isinstance(results, list)
    backend.close()


def test_a_corrupt_value_is_a_miss_and_never_bytes_in_the_pool(store: tuple[str, dict[str, Any]]) -> None:
    backend, host = _backend(store, "mha", "layer_first", seed=5)
    keys = [f"{i:064x}" for i in range(3)]
    # A value under page 1's key before SGLang saves it: write-once keeps it, whoever wrote it.
    key = backend.tier.key(keys[1])
    junk = b"\xab" * (HEADER_BYTES + backend.tier.views.page_bytes)  # the right length, foreign bytes
    raw = backend.tier.guard.call("put", lambda s: s.put([key], [junk]))
    assert list(raw) == [True]
    assert backend.batch_set_v1(keys, host.alloc(3 * PAGE)) == [True] * 3
    target = host.alloc(3 * PAGE)
    untouched = page(host, target, 1)
    assert backend.batch_get_v1(keys, target) == [True, False, True]
    assert torch.equal(page(host, target, 1), untouched) or not page(host, target, 1).any()
    assert backend.get_stats()["load_failed_integrity_foreign"] == 1
    backend.close()


def test_the_generic_calls_round_trip_flat_pages(store: tuple[str, dict[str, Any]]) -> None:
    backend, host = _backend(store, "mha", "page_head", seed=11)
    saved = host.alloc(2 * PAGE)
    pages = [host.get_data_page(int(saved[i * PAGE])) for i in range(2)]
    keys = [f"{i + 50:064x}" for i in range(2)]
    assert backend.batch_set(keys, pages) is True
    assert backend.exists(keys[0]) is True
    got = backend.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(a, b) for a, b in zip(pages, got, strict=True))
    assert backend.get(f"{99:064x}", host.get_dummy_flat_data_page()) is None
    # A zero-copy reader never takes a flat (generic) value: another byte order.
    assert backend.batch_get_v1(keys[:1], host.alloc(PAGE)) == [False]
    backend.close()


def test_a_call_that_raises_inside_the_tier_is_a_miss_never_an_exception(store: tuple[str, dict[str, Any]]) -> None:
    backend, host = _backend(store, "mha", "page_first", seed=13)
    keys = [f"{i + 900:064x}" for i in range(3)]
    one_page = host.alloc(PAGE)  # three keys, one page of slots: the tier cannot pair them
    assert backend.batch_set_v1(keys, one_page) == [False, False, False]
    assert backend.batch_get_v1(keys, one_page) == [False, False, False]
    stats = backend.get_stats()
    assert stats["batch_set_v1_raised"] == 1 and stats["batch_get_v1_raised"] == 1
    backend.close()


# ---------------------------------------------------------------- loads in place (a store called inline)


class _RecordingStore:
    """The store ``inner`` (a ScatterStore), recording which read served each load: ``get`` (staged) or
    ``get_parts`` (in place)."""

    def __init__(self, inner: Any, reads: list[str]) -> None:
        self.inner, self.reads = inner, reads

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, keys: Any, buffers: Any) -> Any:
        self.reads.append("get")
        return self.inner.get(keys, buffers)

    def get_parts(self, keys: Any, parts: Any) -> Any:
        self.reads.append("get_parts")
        return self.inner.get_parts(keys, parts)


def _recording(inline: bool, reads: list[str]) -> type:
    """Mooncake's connector (embedded), its store recorded, declared called inline or not."""
    from kvconn_mooncake import MooncakeConnector

    def open_store(self: Any) -> Any:
        return _RecordingStore(MooncakeConnector.open_store(self), reads)

    return type("RecordingMooncake", (MooncakeConnector,), {"open_store": open_store, "inline_calls": inline})


def _damage(backend: Any, keys: list[str], saved: Any, how: str) -> None:
    """Put a damaged value under ``keys[1]`` before SGLang saves it (write-once keeps it): sealed by kvconn for
    page 1's bytes, then its tag broken (``checksum``), sealed for ``keys[0]`` (``other_key``) or cut by a byte
    (``short``)."""
    tier = backend.tier
    sealed_for = tier.key(keys[0] if how == "other_key" else keys[1])
    value = bytearray(
        b"".join(seal_parts(tier.integrity, [sealed_for], tier.views.digest, [tier.views.pages(saved)[1]])[0])
    )
    if how == "checksum":
        value[-1] ^= 0xFF
    data = bytes(value[:-1] if how == "short" else value)
    assert list(tier.guard.call("put", lambda s: s.put([tier.key(keys[1])], [data]))) == [True]


@pytest.mark.parametrize("how", ["checksum", "other_key", "short"])
@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first")])
def test_a_damaged_value_loaded_in_place_is_a_miss_and_its_page_zeroed(
    namespace: str, how: str, kind: str, layout: str
) -> None:
    backend, host = _backend(("mooncake", {"namespace": namespace}), kind, layout, seed=17)
    reads: list[str] = []
    swap_store_class(backend, host, _recording(True, reads))
    keys = [f"{i + 700:064x}" for i in range(3)]
    saved = host.alloc(3 * PAGE)
    _damage(backend, keys, saved, how)
    assert backend.batch_set_v1(keys, saved) == [True] * 3
    target = host.alloc(3 * PAGE)
    assert page(host, target, 1).any()  # known bytes there: the zeroing below can fail
    assert backend.batch_get_v1(keys, target) == [True, False, True]
    assert reads == ["get_parts"]  # in place: one read, straight into the pool's pages
    assert not page(host, target, 1).any(), "a page that failed verification kept bytes in the pool"
    assert torch.equal(page(host, saved, 0), page(host, target, 0))
    assert torch.equal(page(host, saved, 2), page(host, target, 2))
    assert backend.get_stats()[f"load_failed_integrity_{how}"] == 1
    assert backend.get_stats()["pages_loaded"] == 2
    backend.close()


@pytest.mark.parametrize("inline", [True, False])
def test_only_a_store_declared_inline_is_read_in_place(namespace: str, inline: bool) -> None:
    backend, host = _backend(("mooncake", {"namespace": namespace}), "mha", "page_head", seed=19)
    reads: list[str] = []
    swap_store_class(backend, host, _recording(inline, reads))
    assert backend.tier.guard.inline is inline
    keys = [f"{i + 800:064x}" for i in range(2)]
    saved = host.alloc(2 * PAGE)
    _damage(backend, keys, saved, "checksum")
    assert backend.batch_set_v1(keys, saved) == [True, True]
    target = host.alloc(2 * PAGE)
    before = page(host, target, 1)
    assert backend.batch_get_v1(keys, target) == [True, False]
    assert torch.equal(page(host, saved, 0), page(host, target, 0))
    # In place, the failed page is zeroed; staged, it was never written: the pool keeps what it held.
    assert reads == (["get_parts"] if inline else ["get"])
    assert not page(host, target, 1).any() if inline else torch.equal(page(host, target, 1), before)
    backend.close()


def test_mooncake_is_called_inline_only_for_its_embedded_store(namespace: str) -> None:
    from kvconn_mooncake import MooncakeConnector
    from kvconn_mooncake.config import MooncakeConfig

    backend, _ = _backend(("mooncake", {"namespace": namespace}), "mha", "page_first", seed=23)
    assert backend.tier.guard.inline is True
    backend.close()
    # The real store (a master over the network) keeps its deadline: the same property, on its config.
    config = MooncakeConfig(backend="mooncake", master_server_address="127.0.0.1:1", metadata_server="http://m/x")
    assert MooncakeConnector.inline_calls.fget(types.SimpleNamespace(config=config)) is False  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_each_page_view_is_the_piece_sglang_names(kind: str, layout: str) -> None:
    """A page's views start where the pool's ``get_page_buffer_meta`` puts its pieces and are as long, in order."""
    import ctypes

    from kvconn_sglang.pages import PageViews

    _, host = make_pools(kind, layout)
    views = PageViews(host)
    slots = host.alloc(3 * PAGE)
    pointers, sizes = host.get_page_buffer_meta(slots)
    pieces = [view for pieces in views.pages(slots) for view in pieces]
    assert [ctypes.addressof(ctypes.c_char.from_buffer(view)) for view in pieces] == pointers
    assert [view.nbytes for view in pieces] == sizes


@pytest.mark.parametrize("past", [1, 1 << 40])
def test_a_piece_outside_the_pools_host_tensors_is_refused(past: int) -> None:
    """A piece that runs past the end of the pool's memory (by a byte, or far) is an error, never a view of other
    memory."""
    from kvconn_sglang.pages import PageViews

    _, host = make_pools("mha", "page_first")
    views = PageViews(host)
    end = host.kv_buffer.data_ptr() + host.kv_buffer.numel() * host.kv_buffer.element_size()
    pointers, sizes = host.get_page_buffer_meta(host.alloc(PAGE))
    host.get_page_buffer_meta = lambda _: ([*pointers[:-1], end - sizes[-1] + past], sizes)
    with pytest.raises(ValueError, match="outside its host tensors"):
        views.pages(host.alloc(PAGE))
