"""What operators see of kvconn in vLLM 0.33: stats, Prometheus series, the tier of hits, KV events, config errors.

Driven through vLLM's real scheduler (``log_stats`` on, as a server runs it)
and its own metrics classes: what reaches ``SchedulerStats`` is what vLLM's
front end turns into ``/metrics``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from kvconn.errors import ConnectorConfigError, ConnectorNotFoundError
from kvconn_vllm.testing.harness import VllmLoop, make_request, make_scheduler

# 4 full blocks of 16, seen by no other test: Mooncake's embedded store lives as long as the process
PREFIX = list(range(8100, 8164))


def stats_of(engine_core_outputs: dict[int, Any]) -> Any:
    eco = next(iter(engine_core_outputs.values()), None)
    return None if eco is None else eco.scheduler_stats


@pytest.fixture
def publishing(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM configs built from now on publish KV-cache events (to vLLM's null publisher)."""
    import vllm.config
    import vllm.v1.executor  # imported first: its modules annotate with VllmConfig | None
    from vllm.config import KVEventsConfig

    config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    monkeypatch.setattr(vllm.config, "VllmConfig", functools.partial(vllm.config.VllmConfig, kv_events_config=config))


def reuse_prefix(connectors: str | list[str], config: Any = None) -> tuple[Any, list[Any]]:
    """A runs (its blocks are saved), vLLM's own cache is emptied, B with A's prefix runs: the scheduler stats."""
    scheduler = make_scheduler(connectors, config, num_blocks=64)
    loop = VllmLoop(scheduler)
    collected: list[Any] = []

    def run() -> None:
        while scheduler.has_requests():
            collected.append(stats_of(loop.step()[1]))

    scheduler.add_request(make_request("a", [*PREFIX, 1, 2, 3], max_tokens=2))
    run()
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", [*PREFIX, 7, 8, 9], max_tokens=2))
    run()
    return scheduler, [s for s in collected if s is not None]


def kvconn_stats(all_stats: list[Any]) -> Any:
    from kvconn_vllm import KVConnVllmStats

    total = KVConnVllmStats(data={})
    for stats in all_stats:
        if stats.kv_connector_stats:
            total = total.aggregate(KVConnVllmStats(data=stats.kv_connector_stats))
    return total


def test_offload_stats_hold_counters_lookups_gauges_and_step_seconds() -> None:
    _, all_stats = reuse_prefix("offload")
    data = kvconn_stats(all_stats).data
    # A's 4 blocks saved (B's prefix is A's: nothing new to save but B's own tail, under a block), B's loaded.
    assert data["offload.blocks_saved"] == 4 and data["offload.blocks_loaded"] == 4
    assert data["offload.lookups"] == 2 and data["offload.hit_blocks"] == 4
    assert data["offload.missed_blocks"] == 4  # A: 4 full blocks, none cached anywhere
    assert data["gauges"].keys() == {"offload.pool_used_blocks", "offload.pool_blocks"}
    assert data["gauges"]["offload.pool_used_blocks"] == 4 and data["gauges"]["offload.pool_blocks"] >= 4
    assert len(data["seconds"]["offload.load"]) == 1 and len(data["seconds"]["offload.save"]) >= 1
    assert all(s >= 0 for s in data["seconds"]["offload.save"])
    assert not any(key.startswith("offload._") for key in data)  # private gauges stay private
    line = kvconn_stats(all_stats).reduce()  # vLLM's log line: the counters (whoever sums the lines gets totals)
    assert line == {k: v for k, v in data.items() if k not in ("gauges", "seconds")}


def test_failed_loads_and_degraded_events_by_reason(test_connectors: str) -> None:
    """A connector whose worker raises on a load: one failed load, one degraded start_load_kv, in Prometheus too."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    name = f"{test_connectors}:HandoffConnector"
    scheduler = make_scheduler(name, {"delay_free": False, "hit_tokens": 64, "fail_load": True}, on_error="degrade")
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("hit0", list(range(96)), max_tokens=2))
    all_stats = []
    while scheduler.has_requests():
        all_stats.append(stats_of(loop.step()[1]))
    all_stats = [s for s in all_stats if s is not None]
    data = kvconn_stats(all_stats).data
    assert data[f"{name}.failed_loads"] == 1 and data[f"{name}.degraded.start_load_kv_error"] == 1
    logger = PrometheusStatLogger(scheduler.vllm_config)
    for stats in all_stats:
        logger.record(scheduler_stats=stats, iteration_stats=None)
    labels = {"engine": "0", "connector": name, "model_name": str(scheduler.vllm_config.model_config.served_model_name)}
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("vllm:kvconn_failed_loads_total", labels) == 1
    reason = {**labels, "reason": "start_load_kv_error"}
    assert registry.get_sample_value("vllm:kvconn_degraded_events_total", reason) == 1


def test_host_hits_are_counted_under_vllms_host_source() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _, all_stats = reuse_prefix("offload")
    by_source: dict[Any, int] = {}
    for stats in all_stats:
        if stats.connector_prefix_cache_stats is not None:
            for source, n in stats.connector_prefix_cache_stats.hits_by_source.items():
                by_source[source] = by_source.get(source, 0) + n
    assert by_source == {CacheHitSource.HOST: 64}


def test_a_remote_store_is_vllms_unspecified_source_and_the_loader_decides_with_two_connectors() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    scheduler = make_scheduler(["mooncake", "offload"], num_blocks=64)
    connector = scheduler.connector
    assert (
        connector.connector_scheduler._telemetry["mooncake"].tier == "remote"
        and connector.connector_scheduler._telemetry["offload"].tier == "host"
    )
    request = make_request("r", [*PREFIX, 1], max_tokens=1)
    for loader, source in (("mooncake", CacheHitSource.EXTERNAL_UNSPECIFIED), ("offload", CacheHitSource.HOST)):
        connector.connector_scheduler._loader = ("r", loader)
        assert connector.get_external_cache_hit_sources(request, 32) == {source: 32}
    assert connector.get_external_cache_hit_sources(request, 0) == {}


def test_prometheus_series_per_connector_from_vllms_own_logger() -> None:
    """vLLM's PrometheusStatLogger builds kvconn's series and records a run's stats; the registry holds them."""
    import prometheus_client
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    scheduler, all_stats = reuse_prefix(["offload", "mooncake"])
    logger = PrometheusStatLogger(scheduler.vllm_config)
    for stats in all_stats:
        logger.record(scheduler_stats=stats, iteration_stats=None)
    registry = prometheus_client.REGISTRY

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0", **labels})

    model = str(scheduler.vllm_config.model_config.served_model_name)
    data = kvconn_stats(all_stats).data
    assert value("vllm:kvconn_blocks_saved_total", connector="offload", model_name=model) == 4
    # Mooncake saves on its store thread: how many of its saves were reported by the run's end varies
    assert value("vllm:kvconn_blocks_saved_total", connector="mooncake", model_name=model) == data.get(
        "mooncake.blocks_saved"
    )
    for connector in ("offload", "mooncake"):
        assert value("vllm:kvconn_lookups_total", connector=connector, model_name=model) == 2
    # One of them loads B's 4 blocks (the first with a hit: offload, unless its store was not reported done yet);
    # each connector missed A's 4 blocks and those of B it did not load.
    names = ("offload", "mooncake")
    hits = {c: value("vllm:kvconn_hit_blocks_total", connector=c, model_name=model) or 0 for c in names}
    assert sorted(hits.values()) == [0, 4]
    for connector, hit in hits.items():
        assert value("vllm:kvconn_missed_blocks_total", connector=connector, model_name=model) == 8 - hit
    assert value("vllm:kvconn_pool_used_blocks", connector="offload", model_name=model) == 4
    assert value("vllm:kvconn_load_seconds_count", connector="offload", model_name=model) == 1
    assert value("vllm:kvconn_save_seconds_count", connector="mooncake", model_name=model) >= 1


def publish_prefix(connector: str, config: Any) -> tuple[Any, Any, list[Any], Any]:
    """vLLM's scheduler with ``connector``, one request of PREFIX run: the scheduler, its loop, what vLLM
    published (its batches of events) and the request."""
    scheduler = make_scheduler(connector, config, num_blocks=64)
    published: list[Any] = []
    scheduler.kv_event_publisher.publish = published.append  # what vLLM would send its subscribers
    loop = VllmLoop(scheduler)
    request = make_request("a", [*PREFIX, 1, 2, 3], max_tokens=2)
    scheduler.add_request(request)
    loop.run()
    return scheduler, loop, published, request


@pytest.mark.usefixtures("publishing")
def test_events_of_what_offload_stores_and_evicts_reach_vllms_publisher() -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    scheduler, loop, published, request = publish_prefix("offload", {"pool_blocks": 4})
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    events = [e for batch in published for e in batch.events]
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert [h for e in stored for h in e.block_hashes] == hashes[:4] and {e.block_size for e in stored} == {16}
    # the hashes a router got for these blocks on the device
    on_device = {h for e in events if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert set(hashes[:4]) <= on_device
    other = make_request("b", [*range(7000, 7032), 1], max_tokens=1)  # 2 new blocks in a full pool: 2 evicted
    scheduler.add_request(other)
    loop.run()
    events = [e for batch in published for e in batch.events if e.medium == "CPU"]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == hashes[:2]


@pytest.mark.usefixtures("publishing")
def test_events_of_what_redis_stores_and_fails_to_load_reach_vllms_publisher(redis_server: Any) -> None:
    """A store connector (a real redis-server): stored once the store holds the values, removed once a load fails."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    scheduler, loop, published, request = publish_prefix("redis", {"url": redis_server.url, "save_async": False})

    def remote(kind: type) -> list[Any]:
        return [e for batch in published for e in batch.events if isinstance(e, kind) and e.medium == "STORAGE"]

    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    stored = remote(BlockStored)
    assert [h for e in stored for h in e.block_hashes] == hashes[:4] and {e.block_size for e in stored} == {16}
    assert remote(BlockRemoved) == []
    client = redis_server.client()
    for key in client.keys("kvconn/*"):  # every value damaged: each fails verification when loaded
        value = client.get(key)
        client.set(key, value[:-1] + bytes([value[-1] ^ 1]))
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(make_request("b", [*PREFIX, 7, 8, 9], max_tokens=2))
    loop.run()
    assert sorted(h for e in remote(BlockRemoved) for h in e.block_hashes) == sorted(hashes[:4])


def test_events_fit_a_vllm_whose_event_structs_lack_the_newer_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older vLLM's BlockStored has no medium or lora_name: the events are built with the fields it has."""
    import msgspec
    import vllm.distributed.kv_events as kv_events

    from kvconn.telemetry import BlockStored
    from kvconn_vllm.telemetry import to_vllm_events

    class OlderBlockStored(msgspec.Struct):
        block_hashes: list[Any]
        parent_block_hash: Any
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    monkeypatch.setattr(kv_events, "BlockStored", OlderBlockStored)
    (event,) = to_vllm_events([BlockStored([b"\x01" * 32], 16)], "host")
    assert isinstance(event, OlderBlockStored) and event.block_size == 16 and len(event.block_hashes) == 1


def test_no_events_are_recorded_when_vllm_publishes_none() -> None:
    scheduler = make_scheduler("offload", num_blocks=64)
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("a", [*PREFIX, 1, 2, 3], max_tokens=2))
    loop.run()
    manager = scheduler.connector.host.connectors["offload"].side.manager
    assert manager._stored is None  # never asked: nothing kept


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        ({"kvconn_connector": "offload", "kvconn_confg": {}}, ConnectorConfigError, ["kvconn_confg", "kvconn_config"]),
        (
            {"kvconn_connector": "offload", "kvconn_on_eror": "raise"},
            ConnectorConfigError,
            ["kvconn_on_eror", "did you mean 'kvconn_on_error'"],
        ),
        ({"kvconn_connector": "ofload"}, ConnectorNotFoundError, ["ofload", "offload", "kvconn validate ofload"]),
        (
            {"kvconn_connector": "offload", "kvconn_config": {"pool_blockz": 4}},
            ConnectorConfigError,
            ["pool_blockz", "kvconn validate offload --config '{\"pool_blockz\": 4}'"],
        ),
        ({"kvconn_connector": "offload", "kvconn_on_error": "ignore"}, ConnectorConfigError, ["'degrade' or 'raise'"]),
    ],
)
def test_a_bad_extra_config_is_refused_by_the_first_call_vllm_makes_with_it(
    extra: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    """vLLM's front end asks requires_piecewise_for_cudagraph (full CUDA graphs) before any engine starts."""
    from kvconn_vllm import KVConnVllmConnector

    with pytest.raises(error) as info:
        KVConnVllmConnector.requires_piecewise_for_cudagraph(extra)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("extra", "error", "word"),
    [
        ({"kvconn_connector": "ofload"}, ConnectorNotFoundError, "kvconn validate ofload"),
        ({"kvconn_connector": "offload", "kvconn_config": {"pool_blockz": 4}}, ConnectorConfigError, "pool_blockz"),
        ({"kvconn_connector": "offload", "kvconn_confg": {}}, ConnectorConfigError, "kvconn_confg"),
    ],
)
def test_a_bad_extra_config_stops_vllms_kv_cache_layout_resolution(
    extra: dict[str, Any], error: type[Exception], word: str
) -> None:
    """Without full CUDA graphs (a CPU engine) vLLM's engine core first hands over the config here, once.

    vLLM's own helper resolves the connector class through its factory and asks the class, as the engine
    core's ``resolve_kv_cache_layout`` does before memory profiling and before any worker builds a connector.
    """
    import types

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    transfer = KVTransferConfig(kv_connector="KVConnVllmConnector", kv_connector_module_path="kvconn_vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)  # fmt: skip
    with pytest.raises(error, match=word):
        get_kv_connector_cache_layout(types.SimpleNamespace(kv_transfer_config=transfer))
    good = KVTransferConfig(kv_connector="KVConnVllmConnector", kv_connector_module_path="kvconn_vllm",
                            kv_role="kv_both", kv_connector_extra_config={"kvconn_connector": "offload"})  # fmt: skip
    assert get_kv_connector_cache_layout(types.SimpleNamespace(kv_transfer_config=good)) is None  # no layout asked


def test_a_misspelt_key_stops_the_connector_and_a_good_config_passes_the_early_check() -> None:
    from kvconn_vllm import KVConnVllmConnector

    assert KVConnVllmConnector.requires_piecewise_for_cudagraph({"kvconn_connector": "offload"}) is False
    with pytest.raises(ConnectorConfigError, match="kvconn_confg"):
        make_scheduler(None, transfer_fields={
            "kv_connector": "KVConnVllmConnector",
            "kv_connector_module_path": "kvconn_vllm",
            "kv_connector_extra_config": {"kvconn_connector": "offload", "kvconn_confg": {"pool_blocks": 8}},
        })  # fmt: skip
