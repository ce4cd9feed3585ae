"""The connector's behaviour on the embedded backend (in-process, no master).

The same scenarios run against the real store in ``test_real_store.py``.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import pytest

import kvconn_mooncake.connector
from kvconn import ConnectorConfigError, SchedulerOutput, load_connector
from kvconn.context import KVCacheGroupSpec
from kvconn.reference import Engine
from kvconn.store import StoreMetadata
from kvconn_mooncake import EmbeddedStore, MooncakeConnector
from kvconn_mooncake.codes import LEASE_EXPIRED, NOT_FOUND, RPC_FAIL


@pytest.mark.parametrize(("block_size", "save_async"), [(16, False), (256, False), (16, True)])
def test_save_then_load_is_bit_exact(
    scenarios: types.ModuleType, embedded_config: dict, block_size: int, save_async: bool
) -> None:
    config = {**embedded_config, "save_async": save_async}
    scenarios.check_save_then_load(scenarios.save_then_load(config, block_size), block_size)


@pytest.mark.parametrize("block_size", [16, 256])
def test_block_fill_step_saves_the_block_it_fills(
    scenarios: types.ModuleType, embedded_config: dict, block_size: int
) -> None:
    scenarios.check_fill_steps(scenarios.fill_steps(embedded_config, block_size))


def test_engines_that_differ_never_share_blocks(scenarios: types.ModuleType, embedded_config: dict) -> None:
    scenarios.check_isolation(scenarios.isolation(embedded_config))


def test_store_too_small_skips_saves_and_counts_them(scenarios: types.ModuleType, embedded_config: dict) -> None:
    r = scenarios.store_full({**embedded_config, "embedded_capacity_bytes": 100 << 10})  # < one 128 KiB block
    assert r["same_tokens"]
    assert r["stats"]["save_failed_refused"] > 0 and r["stats"]["blocks_saved"] == 0


class FaultyStore:
    """An embedded store whose gets, or all calls, fail with a chosen code."""

    def __init__(self, inner: EmbeddedStore, *, get_code: int | None = None, all_code: int | None = None) -> None:
        self.inner, self.get_code, self.all_code = inner, get_code, all_code
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _fail(self, code: int | None, keys: Sequence[str]) -> list[int] | None:
        return None if code is None else [code] * len(keys)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self.calls.append("batch_is_exist")
        return self._fail(self.all_code, keys) or self.inner.batch_is_exist(keys)

    def batch_put_from(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> list[int]:
        return self._fail(self.all_code, keys) or self.inner.batch_put_from(keys, ptrs, sizes)

    def batch_get_into(self, keys: Sequence[str], ptrs: Any, sizes: Any) -> list[int]:
        code = self.all_code if self.all_code is not None else self.get_code
        return self._fail(code, keys) or self.inner.batch_get_into(keys, ptrs, sizes)


@pytest.fixture
def faulty(monkeypatch: pytest.MonkeyPatch) -> FaultyStore:
    """Every embedded store the connector opens is this one (faults off until a test sets them)."""
    store = FaultyStore(EmbeddedStore(1 << 30))
    monkeypatch.setattr(kvconn_mooncake.connector, "embedded_store", lambda name, capacity: store)
    return store


@pytest.mark.parametrize(
    ("code", "counter"),
    [
        (LEASE_EXPIRED, "load_failed_missing"),  # what an expired lease left in the buffer is undefined
        (NOT_FOUND, "load_failed_missing"),
        (RPC_FAIL, "load_failed_store_off"),  # the store raised: it is off until a probe answers
    ],
)
def test_failed_loads_are_recomputed(
    scenarios: types.ModuleType, faulty: FaultyStore, embedded_config: dict, code: int, counter: str
) -> None:
    faulty.get_code = code
    r = scenarios.load_failures(embedded_config)
    scenarios.check_failed_loads(r, counter)
    assert r["stats"]["blocks_loaded"] == 0


def test_engines_of_another_kv_shape_never_share_blocks(scenarios: types.ModuleType, embedded_config: dict) -> None:
    """The KV shape is in the context, so in the key namespace: another head_dim finds nothing to load."""
    scenarios.save_then_load(embedded_config, 16, head_dim=4)
    r = scenarios.load_failures(embedded_config, head_dim=8)
    assert r["same_tokens"]
    assert r["first"]["blocks_saved"] > 0  # head_dim 8 blocks saved under keys the head_dim 4 run did not use
    assert r["first"]["prompt_tokens_loaded"] == 0 and r["stats"]["failed_load_blocks"] == 0


def test_master_down_means_no_saves_and_no_hits(
    scenarios: types.ModuleType, faulty: FaultyStore, embedded_config: dict
) -> None:
    faulty.all_code = RPC_FAIL
    r = scenarios.load_failures(embedded_config)
    assert r["same_tokens"]
    assert r["first"]["blocks_saved"] == 0 and r["first"]["save_failed_store_off"] > 0
    assert r["stats"]["prompt_tokens_loaded"] == 0 and r["stats"]["scheduler_lookup_failed"] > 0
    faulty.all_code = None  # back: saves and hits resume
    r = scenarios.load_failures(embedded_config)
    assert r["same_tokens"] and r["first"]["blocks_saved"] > 0 and r["stats"]["prompt_tokens_loaded"] > 0


def test_lookup_is_memoised_and_has_no_side_effects(faulty: FaultyStore, embedded_config: dict) -> None:
    with Engine("mooncake", embedded_config) as writer:
        writer.generate([list(range(100))], max_tokens=1)
    scheduler = load_connector("mooncake", role="scheduler", config=embedded_config, context=writer.context).side
    request = Engine().add_request(list(range(100)), max_tokens=1)
    faulty.calls.clear()
    first = scheduler.get_num_new_matched_tokens(request, 0)
    assert scheduler.get_num_new_matched_tokens(request, 0) == first == (96, False)
    assert faulty.calls == ["batch_is_exist"] and scheduler.get_num_tracked_requests() == 0
    assert scheduler.get_num_new_matched_tokens(request, 32) == (64, False)  # beyond a local hit
    scheduler.shutdown()


def _spy_metadata(engine: Engine) -> list[StoreMetadata]:
    """The mooncake metadata of each step the engine schedules from now on."""
    seen: list[StoreMetadata] = []
    schedule = engine.scheduler.schedule

    def spy() -> SchedulerOutput:
        output = schedule()
        seen.append(output.kv_connector_metadata["mooncake"])
        return output

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return seen


def test_no_save_on_a_load_step_and_held_blocks_saved_after_finish(
    scenarios: types.ModuleType, embedded_config: dict
) -> None:
    prefix = scenarios.prompts(1, 64, 0)[0]
    with Engine("mooncake", embedded_config) as writer:
        writer.generate([[*prefix, 1]], max_tokens=1)
    prompt = prefix + list(range(40))  # loads 4 blocks, computes 2.5 more and finishes on that step
    sync = {**embedded_config, "save_async": False}  # a finished request is held until its put (in the step) lands
    with Engine("mooncake", sync) as reader:
        seen = _spy_metadata(reader)
        assert reader.generate([prompt], max_tokens=1) == Engine().generate([prompt], max_tokens=1)
        assert reader.stats.prompt_tokens_loaded == 64
        load_steps = [m for m in seen if m.loads]
        assert len(load_steps) == 1 and load_steps[0].saves == []
        (final,) = [m for m in seen if m.finished_saves]
        assert len(final.saves) == 2 and final is not load_steps[0]
        assert reader.scheduler.held_requests == set() and scenarios.totals(reader)["blocks_saved"] == 2


@pytest.mark.parametrize("save_decode", [False, True])
def test_decode_blocks_saved_only_when_asked(embedded_config: dict, save_decode: bool) -> None:
    config = {**embedded_config, "save_decode": save_decode}
    with Engine("mooncake", config) as engine:
        engine.generate([list(range(40))], max_tokens=30)  # 2 prompt blocks, 2 more filled in decode
        assert engine.stats.blocks_saved == (4 if save_decode else 2)


def test_sliding_window_never_moves_the_null_block(embedded_config: dict) -> None:
    groups = (KVCacheGroupSpec(("full.0",)), KVCacheGroupSpec(("swa.0",), sliding_window=32))
    options = {"kv_cache_groups": groups, "num_blocks": 128, "max_num_batched_tokens": 48}
    work = [[*range(200), 7, 8, 9]]
    baseline = Engine(**options).generate(work, max_tokens=3)
    with Engine("mooncake", embedded_config, **options) as writer:
        assert writer.generate(work, max_tokens=3) == baseline
        with Engine("mooncake", embedded_config, **options) as reader:
            seen = _spy_metadata(reader)
            assert reader.generate(work, max_tokens=3) == baseline
            assert reader.stats.prompt_tokens_loaded == 192 and reader.stats.failed_load_blocks == 0
    transfers = [t for m in seen for t in m.loads + m.saves]
    loaded_swa = [t for m in seen for t in m.loads if t.group == 1]
    assert transfers and all(t.block_id != 0 for t in transfers)
    assert 0 < len(loaded_swa) < 12  # only the window's blocks of the sliding-window group


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"global_segment_size": 1024}, "field 'global_segment_size': expected int >= 16777216"),
        ({"save_decode": "often"}, "field 'save_decode': expected bool"),
        ({"backend": "redis"}, "field 'backend'"),
        ({"master_server_address": "no-port"}, "field 'master_server_address': expected 'host:port'"),
        ({"backend": "mooncake"}, "field 'master_server_address'"),
        ({"master_server_address": "h:1", "metadata_server": "m", "protocol": "udp"}, "field 'protocol'"),
        ({"colour": "red"}, "unknown field 'colour'"),
        # Bounds: each of these passed validation and failed at start (OverflowError) or never finished.
        ({"setup_timeout_s": 1e12}, "field 'setup_timeout_s': expected float <= 3600.0"),
        ({"retry_interval_s": float("inf")}, "field 'retry_interval_s': expected float <= 3600.0"),
        ({"timeout_s": 0}, "field 'timeout_s': expected float > 0.0"),
        ({"global_segment_size": 2**70}, "field 'global_segment_size': expected int <= 17592186044416"),
        ({"embedded_capacity_bytes": 2**63}, "field 'embedded_capacity_bytes': expected int <= 17592186044416"),
        ({"integrity_secret": "short"}, "field 'integrity_secret': expected str of length >= 16"),
    ],
)
def test_bad_config_names_the_field(config: dict, message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message.replace("(", r"\(")):
        load_connector("mooncake", role="scheduler", config=config)


def test_environment_selects_the_real_store_and_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1")
    with pytest.raises(ConnectorConfigError, match=r"field 'master_server_address' \(from MOONCAKE_MASTER\)"):
        load_connector("mooncake", role="scheduler")
    monkeypatch.delenv("MOONCAKE_MASTER")
    connector = load_connector("mooncake", role="scheduler")
    assert isinstance(connector, MooncakeConnector) and connector.backend == "embedded"
    assert connector.in_process_state  # decided by the side's store: the embedded one lives in this process
    connector.side.shutdown()


def test_every_simulate_round_starts_with_a_cold_embedded_store(embedded_config: dict) -> None:
    """The embedded store outlives its engine; simulate's rounds must still each measure a cold start.

    Warm, the timed rounds saved nothing (the warm-up had stored every block) and loaded far more than a
    first run can: the comparison with a per-engine store such as offload's was skewed.
    """
    from kvconn.reference.simulate import ConnectorSetup
    from kvconn.reference.workloads import make_workload
    from kvconn_cli.measure import simulate

    work = make_workload("shared-prefix", 16, 0)
    (run,) = simulate(work, [ConnectorSetup(("mooncake",), embedded_config)], repeats=2).runs
    assert run.verified and run.stats.blocks_saved > 0
    fresh = {**embedded_config, "embedded_store": embedded_config["embedded_store"] + "-fresh"}
    cold = simulate(work, [ConnectorSetup(("mooncake",), fresh)], repeats=1).runs[0]
    assert (run.stats.blocks_saved, run.stats.blocks_loaded) == (cold.stats.blocks_saved, cold.stats.blocks_loaded)
