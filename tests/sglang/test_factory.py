"""SGLang's StorageBackendFactory loads the kvconn tier by module path, and refuses what is not a store."""

from __future__ import annotations

import pytest

import kvconn_sglang
from kvconn_sglang.testing.rig import extra, make_pools, storage_config


def _create(extra_config: dict, host: object) -> object:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", storage_config(extra_config), host)


def test_the_dynamic_backend_is_the_kvconn_tier(namespace: str) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    _, host = make_pools("mha", "page_first")
    backend = _create(extra("mooncake", {"namespace": namespace}), host)
    assert isinstance(backend, HiCacheStorage)
    assert type(backend) is kvconn_sglang.KVConnStorage
    backend.register_mem_pool_host(host)
    assert backend.batch_exists(["00" * 32]) == 0
    backend.close()


def test_a_module_path_names_a_store_too(namespace: str) -> None:
    _, host = make_pools("mha", "layer_first")
    backend = _create(extra("kvconn_mooncake:MooncakeConnector", {"namespace": namespace}), host)
    backend.register_mem_pool_host(host)
    assert backend.tier.store_class.__name__ == "MooncakeConnector"
    backend.close()


def test_a_connector_that_is_not_a_store_is_refused_by_name() -> None:
    _, host = make_pools("mha", "page_first")
    with pytest.raises(kvconn_sglang.StoreSpecError, match=r"'dummy'.*not a kvconn store connector"):
        _create(extra("dummy"), host)


def test_a_bad_store_option_is_named_before_serving() -> None:
    _, host = make_pools("mha", "page_first")
    with pytest.raises(kvconn_sglang.StoreSpecError, match="timeout_s"):
        _create(extra("redis", {"timeout_s": "soon"}), host)


def test_no_store_named() -> None:
    _, host = make_pools("mha", "page_first")
    config = extra("redis")
    del config["kvconn_store"]
    with pytest.raises(kvconn_sglang.StoreSpecError, match="kvconn_store"):
        _create(config, host)
