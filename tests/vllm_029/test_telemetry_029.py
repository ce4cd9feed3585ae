"""kvconn's telemetry on vLLM 0.29.0, which has Prometheus per connector and KV events but no cache-hit sources.

0.29 never asks ``get_external_cache_hit_sources`` (its scheduler counts connector hits without a source), so
the adapter's series and events must work without it: the adapter imports vLLM's ``CacheHitSource`` only
when a vLLM that has it asks.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from kvconn_vllm.testing.harness import VllmLoop, make_request, make_scheduler

PREFIX = list(range(8200, 8264))  # 4 full blocks of 16
#: This tier's venv installs no plugin: offload is loaded from the checkout by its class path.
OFFLOAD_SRC = Path(__file__).parents[2] / "plugins" / "offload" / "src"
OFFLOAD = "kvconn_offload:OffloadConnector"


def test_this_vllm_has_no_cache_hit_sources() -> None:
    import importlib.util

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert importlib.util.find_spec("vllm.v1.metrics.cache_hit_source") is None
    assert not hasattr(KVConnectorBase_V1, "get_external_cache_hit_sources")


def test_prometheus_series_and_events_without_hit_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    import prometheus_client
    import vllm.config
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    monkeypatch.syspath_prepend(str(OFFLOAD_SRC))
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    monkeypatch.setattr(vllm.config, "VllmConfig", functools.partial(vllm.config.VllmConfig, kv_events_config=events))
    scheduler = make_scheduler(OFFLOAD, num_blocks=64)
    published: list[Any] = []
    scheduler.kv_event_publisher.publish = published.append
    loop = VllmLoop(scheduler)
    all_stats = []
    for req_id, tail in (("a", [1, 2, 3]), ("b", [7, 8, 9])):
        scheduler.add_request(make_request(req_id, [*PREFIX, *tail], max_tokens=2))
        while scheduler.has_requests():
            outputs = loop.step()[1]
            eco = next(iter(outputs.values()), None)
            if eco is not None and eco.scheduler_stats is not None:
                all_stats.append(eco.scheduler_stats)
        assert scheduler.reset_prefix_cache()
    logger = PrometheusStatLogger(scheduler.vllm_config)
    for stats in all_stats:
        logger.record(scheduler_stats=stats, iteration_stats=None)
    labels = {
        "engine": "0",
        "connector": OFFLOAD,
        "model_name": str(scheduler.vllm_config.model_config.served_model_name),
    }
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("vllm:kvconn_blocks_loaded_total", labels) == 4
    assert registry.get_sample_value("vllm:kvconn_hit_blocks_total", labels) == 4
    assert registry.get_sample_value("vllm:kvconn_pool_used_blocks", labels) == 4
    stored = [e for batch in published for e in batch.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) == 4
