"""The offload connector driven by the reference engine: loads are correct, bit for bit."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvconn import KVCacheGroupSpec
from kvconn.reference import Engine
from kvconn.testing import assert_scheduler_empty


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 30_000) for _ in range(n)]


def run_capturing(engine: Engine, prompt: list[int], *, max_tokens: int = 4, blocks: int) -> tuple[list[int], Any]:
    """Run one request to the end; its tokens and the KV of its first ``blocks`` blocks, per layer and group.

    The KV is read each step while the request holds its table, so the last
    read is the state its tokens were computed from.
    """
    request = engine.add_request(prompt, max_tokens=max_tokens)
    kv: dict[str, torch.Tensor] = {}
    groups = engine.context.group_of_layer()
    while not request.is_finished:
        engine.step()
        table = engine.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        if table[0]:
            for name, g in groups.items():
                ids = table[g][:blocks]
                kv[name] = engine.worker.kv_caches[name][torch.tensor(ids, dtype=torch.long)].clone()
    engine.run_until_done()
    return list(request.output_token_ids), kv


@pytest.fixture
def prefix() -> list[int]:
    return tokens(256, seed=1)


def _pair(connector: str | None, prefix: list[int], config: dict | None = None, **options: object):
    """Request A, then B sharing A's prefix; B's tokens and prefix KV, and the engine."""
    engine = Engine(connector, config, **{"enable_prefix_caching": False, "num_blocks": 64, **options})
    run_capturing(engine, prefix + tokens(9, seed=2), blocks=0)
    out, kv = run_capturing(engine, prefix + tokens(11, seed=3), blocks=len(prefix) // 16)
    return out, kv, engine


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_prefix_loaded_from_host_is_bit_exact(prefix: list[int], multiple: int, load_async: bool) -> None:
    expected, expected_kv, _ = _pair(None, prefix)
    config = {"pool_blocks": 64, "block_size_multiple": multiple, "load_async": load_async}
    out, kv, engine = _pair("offload", prefix, config)
    assert out == expected
    assert engine.stats.prompt_tokens_loaded == 256 if multiple == 1 else 192  # B has 267 tokens: 4 or 1 whole units
    assert engine.stats.blocks_loaded == engine.stats.prompt_tokens_loaded // 16
    for name, ref in expected_kv.items():
        assert torch.equal(kv[name].view(torch.int16), ref.view(torch.int16)), name
    assert_scheduler_empty(engine.scheduler)
    assert engine.worker_host is not None and engine.worker_host.num_tracked_requests() == {"offload": 0}


@pytest.mark.parametrize(("load_async", "waits"), [("auto", 0), (False, 0), (True, 1)])
def test_a_hit_on_host_kv_caches_loads_in_the_step_that_computes_the_prompt_by_default(
    prefix: list[int], load_async: bool | str, waits: int
) -> None:
    """The reference engine's KV caches are in host memory: ``auto`` loads sync, no step of waiting for the copies."""
    engine = Engine("offload", {"pool_blocks": 64, "load_async": load_async}, enable_prefix_caching=False)
    engine.generate([prefix + tokens(9, seed=2)], max_tokens=1)
    request = engine.add_request(prefix + tokens(11, seed=3), max_tokens=1)
    steps = 0
    while not request.output_token_ids:
        engine.step()
        steps += 1
    assert engine.stats.prompt_tokens_loaded == 256
    assert steps == 1 + waits


def test_no_partial_block_is_saved() -> None:
    engine = Engine("offload", {"pool_blocks": 64}, enable_prefix_caching=False, num_blocks=64)
    engine.generate([tokens(40, seed=4)], max_tokens=7)  # 46 tokens computed: two full blocks
    assert engine.stats.blocks_saved == 2
    assert engine.stats.bytes_saved == 2 * 2 * engine.worker.kv_caches["layer.0"][0].numel() * 2


def test_lru_under_pressure_keeps_recent_prefixes() -> None:
    # pool of 8 blocks; three 4-block prompts: the first is evicted, the last two stay
    engine = Engine("offload", {"pool_blocks": 8}, enable_prefix_caching=False, num_blocks=64)
    prompts = [tokens(65, seed=s) for s in (10, 11, 12)]
    for p in prompts:  # one at a time: each is saved before the next arrives
        engine.generate([p], max_tokens=1)
    before = engine.stats.prompt_tokens_loaded
    engine.generate([prompts[2], prompts[1], prompts[0]], max_tokens=1)
    assert engine.stats.prompt_tokens_loaded - before == 2 * 64
    manager = engine.scheduler_host.connectors["offload"].side.manager  # type: ignore[union-attr]
    assert manager.evictions >= 4 and len(manager) == 8


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_preemption_and_resume_give_the_same_tokens(load_async: bool) -> None:
    prompts = [tokens(100, seed=s) for s in range(4)]
    expected = Engine(None, num_blocks=400).generate(prompts, max_tokens=40)
    config = {"pool_blocks": 256, "load_async": load_async}
    engine = Engine("offload", config, num_blocks=32, enable_prefix_caching=False)
    assert engine.generate(prompts, max_tokens=40) == expected
    # the preempted requests resume from host memory: no prompt token is computed twice
    assert engine.stats.prompt_tokens_computed == 400 and engine.stats.prompt_tokens_loaded > 0
    if load_async:  # prompt positions: 200 of the 240 tokens loaded; the other 40 were generated ones
        assert engine.stats.preemptions == 2 and engine.stats.prompt_tokens_loaded == 200
    else:  # a resumed request loads and computes in one step, so fewer requests are preempted
        assert engine.stats.preemptions >= 1
    assert engine.stats.failed_load_blocks == 0
    assert_scheduler_empty(engine.scheduler)


def test_two_kv_cache_groups_load_only_the_window(prefix: list[int]) -> None:
    groups = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=40))
    expected, _, _ = _pair(None, prefix, kv_cache_groups=groups)
    out, _, engine = _pair("offload", prefix, {"pool_blocks": 64}, kv_cache_groups=groups)
    assert out == expected
    assert engine.stats.prompt_tokens_loaded == 256
    # full group: 16 blocks; window group: only the blocks the window of token 256 reads (3 blocks)
    assert engine.stats.blocks_loaded == 16 + 3
    assert engine.stats.failed_load_blocks == 0


def test_window_blocks_not_saved_shorten_the_hit() -> None:
    # with 4-block units and a 16-token window, chunks of 16 tokens leave early sub-blocks unsaved
    groups = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=16))
    prompt = tokens(140, seed=7)
    config = {"pool_blocks": 64, "block_size_multiple": 4}
    options: dict[str, Any] = {"enable_prefix_caching": False, "num_blocks": 64, "kv_cache_groups": groups}
    expected = Engine(None, **options).generate([prompt, prompt], max_tokens=3)
    engine = Engine("offload", config, max_num_batched_tokens=16, **options)
    assert engine.generate([prompt], max_tokens=3) + engine.generate([prompt], max_tokens=3) == expected
    assert engine.stats.failed_load_blocks == 0


def test_evicted_slot_is_reported_as_a_load_error_and_recomputed(prefix: list[int]) -> None:
    engine = Engine("offload", {"pool_blocks": 64}, enable_prefix_caching=False, num_blocks=64)
    expected = Engine(None, enable_prefix_caching=False, num_blocks=64).generate([[*prefix, 7]], max_tokens=3)
    engine.generate([[*prefix, 5]], max_tokens=1)
    worker = engine.worker_host.connectors["offload"].side  # type: ignore[union-attr]
    worker._slot_keys.pop(3)  # slot 3 no longer holds what the scheduler thinks (evicted/corrupted)
    assert engine.generate([[*prefix, 7]], max_tokens=3) == expected
    assert engine.stats.failed_load_blocks == 1
    assert_scheduler_empty(engine.scheduler)


NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); scripts/gpu-check.sh runs it on a GPU machine"


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]
)
def test_prefix_loaded_into_the_engine_device_kv_cache_is_bit_exact(prefix: list[int], device: str) -> None:
    """On CUDA: pinned pool, copies on the side stream ordered by events, and the engine's outputs unchanged."""
    expected, expected_kv, _ = _pair(None, prefix, device=device)
    out, kv, engine = _pair("offload", prefix, {"pool_blocks": 64}, device=device)
    assert out == expected and engine.stats.prompt_tokens_loaded == 256
    assert engine.stats.blocks_saved > 0 and engine.stats.degraded_events == 0
    assert engine.worker_host is not None
    worker = engine.worker_host.connectors["offload"].side  # type: ignore[attr-defined]
    assert worker.pinned == (device == "cuda") and worker.pool.is_pinned() == (device == "cuda")
    assert (worker._stream is not None) == (device == "cuda")
    for name, ref in expected_kv.items():
        assert kv[name].device.type == device and torch.equal(kv[name].view(torch.int16), ref.view(torch.int16))
