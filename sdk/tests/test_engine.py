"""The reference engine: exact outputs across scheduling choices, connectors and recovery."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvconn import KVCacheGroupSpec
from kvconn.reference import Engine, EngineShape, RequestStatus
from kvconn.testing import create_scheduler, memory_connector, memory_store
from kvconn.testing.conformance import DriverSpec

MEMORY = f"{memory_connector.__name__}:MemoryConnector"
SWA_GROUPS = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=32))


def prompts(n: int = 6, prefix: int = 70, suffix: int = 25, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32_000) for _ in range(prefix)]
    return [shared + [rng.randrange(32_000) for _ in range(suffix + i)] for i in range(n)]


def run(*args: Any, max_tokens: int = 12, sequential: bool = False, **options: Any) -> tuple[list[list[int]], Engine]:
    """Outputs of ``prompts()``; ``sequential`` finishes each request before the next arrives."""
    engine = Engine(*args, **{"num_blocks": 128, **options})
    if sequential:
        outputs = [engine.generate([p], max_tokens=max_tokens)[0] for p in prompts()]
    else:
        outputs = engine.generate(prompts(), max_tokens=max_tokens)
    engine.close()
    return outputs, engine


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return run(enable_prefix_caching=False)[0]


def test_outputs_do_not_depend_on_batching_chunking_or_caching(baseline: list[list[int]]) -> None:
    assert len(set(map(tuple, baseline))) == len(baseline)  # distinct requests, distinct outputs
    unchunked, whole = run()
    assert unchunked == baseline
    chunked, engine = run(max_num_batched_tokens=16)
    assert chunked == baseline and engine.stats.steps > whole.stats.steps
    assert run(max_num_seqs=1)[0] == baseline


def test_prefix_cache_hits_skip_computation_and_keep_outputs(baseline: list[list[int]]) -> None:
    outputs, engine = run(sequential=True)
    assert outputs == baseline
    assert engine.stats.prompt_tokens_cached >= 5 * 64
    assert engine.stats.prompt_tokens_computed == engine.stats.prompt_tokens - engine.stats.prompt_tokens_cached


def test_preemption_recomputes_and_keeps_outputs() -> None:
    expected, _ = run(enable_prefix_caching=False, max_tokens=40)
    for caching in (False, True):
        outputs, engine = run(num_blocks=20, enable_prefix_caching=caching, max_tokens=40)
        assert engine.stats.preemptions > 0
        assert outputs == expected


def test_sliding_window_group_frees_blocks_and_keeps_outputs_exact() -> None:
    expected, _ = run(kv_cache_groups=SWA_GROUPS, enable_prefix_caching=False, max_tokens=30)
    for options in ({}, {"max_num_batched_tokens": 16}, {"num_blocks": 20}, {"sequential": True}):
        outputs, _ = run(kv_cache_groups=SWA_GROUPS, max_tokens=30, **options)
        assert outputs == expected, options
    engine = Engine(num_blocks=64, kv_cache_groups=SWA_GROUPS)
    request = engine.add_request(prompts()[0], max_tokens=30)
    while engine.scheduler.has_unfinished_requests() and request.num_computed_tokens < 100:
        engine.step()
    full, window = engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assert 0 not in full and window[0] == 0 and window[-1] != 0


def test_wrong_kv_in_the_cache_changes_the_output(baseline: list[list[int]]) -> None:
    engine = Engine(num_blocks=128, enable_prefix_caching=False)
    request = engine.add_request(prompts()[0], max_tokens=12)
    engine.step()
    first_block = engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)[0][0]
    engine.worker.kv_caches["layer.0"][first_block] += 0.5
    engine.run_until_done()
    assert request.output_token_ids[1:] != baseline[0][1:]


def test_dummy_connector_changes_nothing(baseline: list[list[int]]) -> None:
    outputs, engine = run("dummy", enable_prefix_caching=False)
    assert outputs == baseline
    assert engine.stats.degraded_events == 0


@pytest.mark.parametrize("load_async", [False, True])
def test_external_loads_replace_computation_exactly(baseline: list[list[int]], load_async: bool) -> None:
    outputs, engine = run(MEMORY, {"load_async": load_async}, sequential=True, enable_prefix_caching=False)
    assert outputs == baseline
    assert engine.stats.prompt_tokens_loaded >= 5 * 64
    assert engine.stats.prompt_tokens_computed == engine.stats.prompt_tokens - engine.stats.prompt_tokens_loaded


@pytest.mark.parametrize("load_async", [False, True])
def test_failed_loads_are_recomputed_and_never_cached(load_async: bool) -> None:
    shared_a, shared_b = prompts(2)
    unrelated = [random.Random(9).randrange(32_000) for _ in range(200)]
    sequence = [shared_a, unrelated, shared_b, shared_b]  # the unrelated request evicts shared_a's blocks
    options: dict[str, Any] = {"num_blocks": 16}
    with Engine(**options) as plain:
        expected = [plain.generate([p], max_tokens=12)[0] for p in sequence]
    with Engine(MEMORY, {"load_async": load_async, "fail_from_block": 0}, **options) as engine:
        outputs = [engine.generate([p], max_tokens=12)[0] for p in sequence]
    assert engine.stats.failed_load_blocks > 0  # shared_b's prefix was loaded, as garbage, and reported
    assert engine.stats.prompt_tokens_loaded == 0
    # Exact output, and the last run (a local prefix hit) proves no garbage block was cached.
    assert outputs == expected
    assert engine.stats.prompt_tokens_cached > 0


def test_external_loads_into_two_kv_cache_groups() -> None:
    expected, _ = run(kv_cache_groups=SWA_GROUPS, enable_prefix_caching=False)
    for load_async in (False, True):
        memory_store.clear()
        outputs, engine = run(
            MEMORY, {"load_async": load_async}, sequential=True, kv_cache_groups=SWA_GROUPS, enable_prefix_caching=False
        )
        assert outputs == expected
        assert engine.stats.prompt_tokens_loaded > 0


def test_one_engine_shape_sizes_the_engine_the_test_scheduler_and_the_conformance_drivers() -> None:
    engine = Engine(num_blocks=64, head_dim=4, kv_cache_groups=list(SWA_GROUPS))
    assert engine.shape == EngineShape(num_blocks=64, head_dim=4, kv_cache_groups=SWA_GROUPS)
    assert engine.scheduler.config is engine.shape
    assert tuple(engine.worker.kv_caches["layer.1"].shape) == (64, 2, 16, 2, 4)
    assert (engine.context.head_dim, engine.context.kv_cache_groups) == (4, SWA_GROUPS)
    assert Engine(shape=engine.shape, num_blocks=32).shape == engine.shape.replace(num_blocks=32)
    assert create_scheduler(block_size=4).config == EngineShape(block_size=4)
    assert DriverSpec("dummy").shape == EngineShape()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"num_block": 64},
            r"unknown engine shape option\(s\) \['num_block'\]: the fields of EngineShape are block_size",
        ),
        ({"block_size": 0}, "EngineShape block_size must be >= 1, got 0"),
        ({"max_num_seqs": "4"}, r"EngineShape: Expected `int`, got `str` - at `\$.max_num_seqs`"),
        ({"kv_cache_groups": []}, "EngineShape kv_cache_groups must hold at least one group"),
    ],
)
def test_a_bad_engine_shape_option_is_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Engine(**options)
    with pytest.raises(ValueError, match=message):
        create_scheduler(**options)


def test_abort_finishes_a_running_request_and_tells_the_connectors() -> None:
    engine = Engine(MEMORY, num_blocks=64)
    finished: list[str] = []
    engine.scheduler_host.add_monitor(  # type: ignore[union-attr]
        lambda call, args: finished.append(args[0].request_id), calls=["request_finished"]
    )
    request = engine.add_request(list(range(100, 140)), 8, request_id="r")
    engine.step()
    engine.abort("r", "unknown")
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert not engine.scheduler.has_unfinished_requests()
    assert finished == ["r"]


def test_the_worker_side_can_be_configured_apart() -> None:
    engine = Engine(MEMORY, {"load_async": True}, worker_config={"load_async": False}, num_blocks=64)
    scheduler_side = engine.scheduler_host.connectors[MEMORY]  # type: ignore[union-attr]
    worker_side = engine.worker_host.connectors[MEMORY]  # type: ignore[union-attr]
    assert scheduler_side.config.load_async and not worker_side.config.load_async
