"""What makes a page's bytes mean something is in its key: deployments that differ never meet."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvconn_sglang.testing.rig import PAGE, extra, fill_known, make_pools, storage_config


def _backend(store: tuple[str, dict[str, Any]], host: Any, **config: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra(*store), **config), host)
    backend.register_mem_pool_host(host)
    return backend


KEYS = [f"{i + 700:064x}" for i in range(3)]

VARIANTS = {
    "another model": ({"kind": "mha", "layout": "page_first"}, {"model": "org/other"}),
    "another TP rank (head shard)": ({"kind": "mha", "layout": "page_first"}, {"tp": (1, 2)}),
    "another TP size": ({"kind": "mha", "layout": "page_first"}, {"tp": (0, 2)}),
    "another host layout": ({"kind": "mha", "layout": "layer_first"}, {}),
    "another dtype": ({"kind": "mha", "layout": "page_first", "dtype": torch.bfloat16}, {}),
    "MLA, not MHA": ({"kind": "mla", "layout": "page_first"}, {"mla": True}),
    "another layer count": ({"kind": "mha", "layout": "page_first", "layers": 2}, {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_deployment_that_differs_reads_none(store: tuple[str, dict[str, Any]], variant: str) -> None:
    _, host = make_pools("mha", "page_first")
    writer = _backend(store, host)
    fill_known(host, seed=9)
    assert writer.batch_set_v1(KEYS, host.alloc(3 * PAGE)) == [True] * 3
    assert writer.batch_exists(KEYS) == 3
    pools, config = dict(VARIANTS[variant][0]), VARIANTS[variant][1]
    _, other_host = make_pools(pools.pop("kind"), pools.pop("layout"), **pools)
    reader = _backend(store, other_host, **config)
    assert reader.batch_exists(KEYS) == 0
    assert reader.batch_get_v1(KEYS, other_host.alloc(3 * PAGE)) == [False] * 3
    writer.close()
    reader.close()


def test_mla_pages_are_shared_by_every_tp_rank(store: tuple[str, dict[str, Any]]) -> None:
    _, host = make_pools("mla", "page_first")
    writer = _backend(store, host, mla=True, tp=(0, 2))
    fill_known(host, seed=10)
    assert writer.batch_set_v1(KEYS, host.alloc(3 * PAGE)) == [True] * 3
    _, other = make_pools("mla", "page_first")
    assert _backend(store, other, mla=True, tp=(1, 2)).batch_exists(KEYS) == 3
