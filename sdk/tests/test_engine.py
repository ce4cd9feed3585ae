"""The reference engine: exact outputs across scheduling choices, connectors and recovery."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvconn import KVCacheGroupSpec
from kvconn.reference import Engine
from kvconn.testing import memory_connector

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
        memory_connector.STORE.clear()
        outputs, engine = run(
            MEMORY, {"load_async": load_async}, sequential=True, kv_cache_groups=SWA_GROUPS, enable_prefix_caching=False
        )
        assert outputs == expected
        assert engine.stats.prompt_tokens_loaded > 0
