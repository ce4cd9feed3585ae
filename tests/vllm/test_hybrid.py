"""vLLM's hybrid KV cache manager (several KV-cache groups) with kvconn connectors.

The adapter is ``SupportsHMA``, so vLLM keeps its hybrid manager on for a
model with a full-attention and a sliding-window group: connectors see one
table per group, with vLLM's null block where the window dropped a block.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvconn import NULL_BLOCK_ID, BlockIds, KVCacheGroupSpec
from kvconn_vllm.testing.harness import VllmLoop, make_request, make_scheduler

from .test_adapter import offered_tables, reuse_a_prefix_through
from .test_data_checks import FIXTURES

WINDOW = 32
GROUPS = (KVCacheGroupSpec(("full.0", "full.1")), KVCacheGroupSpec(("swa.0",), sliding_window=WINDOW))


def test_the_hybrid_manager_stays_on_and_connectors_see_every_group_with_null_blocks(test_connectors: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    name = f"{test_connectors}:TablesConnector"
    scheduler = make_scheduler(name, kv_cache_groups=GROUPS)
    adapter = scheduler.connector
    assert isinstance(adapter, SupportsHMA)
    assert type(scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert adapter.context.kv_cache_groups == GROUPS
    finished: dict[str, BlockIds] = {}
    host_finished = adapter.host.request_finished

    def record_finished(request: Any, block_ids: BlockIds) -> bool:
        finished[request.request_id] = block_ids
        return host_finished(request, block_ids)

    adapter.host.request_finished = record_finished
    scheduler.add_request(make_request("r0", list(range(100)), max_tokens=20))
    loop = VllmLoop(scheduler)
    offered: list[BlockIds] = []
    last_live: list[BlockIds] = []

    def check(output: Any) -> None:
        if "r0" not in output.num_scheduled_tokens:
            return
        live = scheduler.kv_cache_manager.get_block_ids("r0")
        table = offered_tables(output, name)["r0"]
        assert table == live  # every group, as vLLM's manager holds it now
        offered.append(table)
        last_live[:] = [tuple(list(t) for t in live)]

    loop.run(inspect=check)
    assert all(len(t) == 2 for t in offered) and len(offered) > 3
    full, swa = offered[-1]
    assert NULL_BLOCK_ID not in full
    assert swa[0] == NULL_BLOCK_ID and swa[-1] != NULL_BLOCK_ID  # the window dropped the oldest blocks
    assert finished["r0"] == last_live[0]  # request_finished_all_groups: both groups
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 127


@pytest.mark.parametrize("plugin", ["offload", "mooncake"])
def test_a_shared_prefix_is_loaded_into_every_group_it_is_needed_in(plugin: str) -> None:
    """B's hit loads the full group's whole prefix and, in the sliding-window group, the blocks in its window."""
    full, swa = reuse_a_prefix_through(plugin, kv_cache_groups=GROUPS)
    assert NULL_BLOCK_ID not in full[:4]
    assert NULL_BLOCK_ID in swa[:2]  # blocks before B's window were never allocated, so never loaded


@pytest.mark.usefixtures("old_vllm")
def test_without_vllms_block_state_sliding_window_tables_are_not_guessed(
    caplog: pytest.LogCaptureFixture, test_connectors: str
) -> None:
    """Tracked tables would name blocks the window freed (and vLLM reused): connectors are offered none."""
    name = f"{test_connectors}:TablesConnector"
    scheduler = make_scheduler(name, kv_cache_groups=GROUPS)
    scheduler.add_request(make_request("r0", list(range(100)), max_tokens=20))
    loop = VllmLoop(scheduler)
    offered: list[dict[str, BlockIds]] = []
    with caplog.at_level(logging.INFO, logger="kvconn.vllm"):
        loop.run(inspect=lambda output: offered.append(offered_tables(output, name)))
    assert len(offered) > 3 and all(tables == {} for tables in offered)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "sliding-window" in errors[0].getMessage()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 127


def test_groups_of_different_block_sizes_are_refused_with_the_reason() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroupSpec

    from kvconn import ConnectorConfigError
    from kvconn_vllm.translate import context_from_vllm

    scheduler = make_scheduler("dummy")

    def group(size: int) -> Any:
        spec = FullAttentionSpec(block_size=size, num_kv_heads=2, head_size=32, dtype=torch.float16)
        return VllmGroupSpec([f"layer.{size}"], spec)

    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group(16), group(64)])
    with pytest.raises(ConnectorConfigError, match=r"block sizes \[16, 64\].*one block size for every group"):
        context_from_vllm(scheduler.vllm_config, config)


@pytest.mark.parametrize("connector", ["offload", "mooncake"])
def test_the_two_groups_conformance_scenario_runs_through_vllm(connector: str) -> None:
    from kvconn.testing.conformance.driver_registry import get_driver
    from kvconn.testing.conformance.scenarios import STANDARD, run_scenario

    (scenario,) = [s for s in STANDARD if s.name == "two-groups"]
    trace = run_scenario(get_driver("vllm"), scenario, connector, None)
    assert trace.unsupported is None and trace.error is None and trace.leak is None
    sliding = [table[1] for record in trace.records for table in record.tables.values()]
    assert any(NULL_BLOCK_ID in t for t in sliding)  # the window freed blocks while the connector ran
    assert any(record.metadata is not None and record.offered for record in trace.records)


def _two_groups_run(connector: str, config: Any, fail_loads: str) -> tuple[Any, list[list[int]]]:
    """A then B (A's 64-token prefix) through vLLM's scheduler with two KV-cache groups and a failing load."""
    from kvconn.reference import EngineShape
    from kvconn.testing.conformance import DriverSpec
    from kvconn_vllm.testing.data_driver import VllmDataDriver

    shape = EngineShape(enable_prefix_caching=False, kv_cache_groups=GROUPS)
    driver = VllmDataDriver(DriverSpec(connector, config, shape), fail_loads=fail_loads, scrub_freed=True)  # type: ignore[arg-type]
    prefix = list(range(5000, 5064))
    for req_id, tail in (("a", [1, 2, 3]), ("b", [7, 8, 9, 10])):
        driver.add_request(req_id, [*prefix, *tail], 6)
        for _ in range(200):
            if not driver.has_work():
                break
            driver.step()
    return driver, [driver.generated("a"), driver.generated("b")]


@pytest.mark.usefixtures("runner")
@pytest.mark.parametrize("fail_loads", ["first", "persistent"])
@pytest.mark.parametrize("connector", ["offload", "mooncake", "RemembersFailedLoads"])
def test_a_failed_load_with_two_groups_is_recomputed_through_failed_recving(
    connector: str, fail_loads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.33 raises on ``invalid_block_ids`` with several groups (``Scheduler._handle_invalid_blocks``):
    the adapter reports the failed request in ``failed_recving`` instead, and vLLM recomputes it.

    offload and mooncake load synchronously (vLLM sees their loads as async), the fixture asynchronously.
    """
    import uuid

    from kvconn.reference import Engine

    config = None
    if connector == "mooncake":
        config = {"embedded_store": uuid.uuid4().hex}
    elif connector == "RemembersFailedLoads":
        monkeypatch.syspath_prepend(str(FIXTURES))
        connector = "kvconn_conformance_fixtures.livelock:RemembersFailedLoads"
    driver, generated = _two_groups_run(connector, config, fail_loads)
    assert driver.injected_failure, "no load failed: the test did not test recovery"
    assert not driver.has_work()
    with Engine(None, shape=driver.shape) as engine:
        expected = engine.generate([[*range(5000, 5064), 1, 2, 3], [*range(5000, 5064), 7, 8, 9, 10]], max_tokens=6)
    assert generated == expected  # B recomputed what failed: the reference engine's tokens
    assert driver.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == driver.num_blocks - 1
    driver.close()
