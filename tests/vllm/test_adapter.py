"""kvconn plugins loaded into vLLM's real scheduler through ``kvconn_vllm``."""

from __future__ import annotations

import pickle
import pickletools
from importlib.metadata import entry_points
from typing import Any

import msgspec
import pytest

from kvconn import NULL_BLOCK_ID
from kvconn.host import DEFAULT_STALL_S
from kvconn_vllm.testing import harness
from kvconn_vllm.testing.harness import VllmLoop, make_request, make_scheduler

PROMPT_47 = list(range(1000, 1047))


def sent_metadata(output: Any, name: str, metadata_type: type[Any]) -> Any:
    """Connector ``name``'s metadata out of vLLM's ``SchedulerOutput``, as its workers get it.

    An idle step sends only names: each named connector's workers get its ``Metadata()`` default.
    """
    sent = output.kv_connector_metadata
    if isinstance(sent, tuple):
        assert name in sent, sent
        return metadata_type()
    return msgspec.msgpack.decode(sent.connectors[name], type=metadata_type)


def sent_names(output: Any) -> set[str]:
    """The connectors vLLM's ``SchedulerOutput`` carries metadata for."""
    sent = output.kv_connector_metadata
    return set(sent) if isinstance(sent, tuple) else set(sent.connectors)


def dummy_meta(output: Any) -> Any:
    """The dummy's metadata out of vLLM's ``SchedulerOutput``, decoded as a worker does."""
    from kvconn_dummy import DummyMetadata

    return sent_metadata(output, "dummy", DummyMetadata)


def offered_tables(output: Any, name: str) -> dict[str, Any]:
    """What ``kvconn_test_connectors.TablesConnector`` (loaded as ``name``) shipped: the tables it was offered."""
    from kvconn_test_connectors import TablesMetadata

    return sent_metadata(output, name, TablesMetadata).tables


def test_vllm_loads_dummy_by_module_path() -> None:
    from kvconn_vllm import KVConnVllmConnector

    scheduler = make_scheduler("dummy")
    adapter = scheduler.connector
    assert type(adapter) is KVConnVllmConnector
    assert adapter.host.names == ["dummy"]
    assert adapter.context.block_size == 16
    assert adapter.context.dtype == "float16"
    assert adapter.context.kv_cache_groups[0].layer_names == harness.LAYERS


def test_general_plugin_registers_short_name_idempotently() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    assert "kvconn" in {ep.name for ep in entry_points(group="vllm.general_plugins")}
    load_general_plugins()
    from kvconn_vllm import register

    register()  # a second call must not raise "already registered"
    assert "kvconn" in KVConnectorFactory._registry
    scheduler = make_scheduler("dummy", short_name=True)
    assert scheduler.connector.host.names == ["dummy"]


def test_missing_connector_name_is_a_clear_error() -> None:
    from kvconn import ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="kvconn_connector"):
        make_scheduler([])


@pytest.mark.usefixtures("runner")
def test_block_fill_step_reaches_plugin_with_live_table() -> None:
    scheduler = make_scheduler("dummy")
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=4))
    loop = VllmLoop(scheduler)
    loop.step()
    output, _ = loop.step()  # token 48 fills block 3: nothing is allocated
    assert output.scheduled_cached_reqs.new_block_ids == [None]
    live = scheduler.kv_cache_manager.get_block_ids("r0")
    assert len(live[0]) == 3
    assert dummy_meta(output).block_ids_by_req == {"r0": ([live[0][2]],)}  # the block this step filled
    assert output.kv_connector_block_state is None  # vLLM dropped it after build_connector_meta


def test_metadata_survives_pickling_as_vllm_sends_it() -> None:
    from kvconn_vllm import KVConnVllmMetadata

    scheduler = make_scheduler("dummy")
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=2))
    output = scheduler.schedule()
    back = pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
    assert isinstance(back.kv_connector_metadata, KVConnVllmMetadata)
    assert dummy_meta(back) == dummy_meta(output)
    full = tuple(ids[:2] for ids in scheduler.kv_cache_manager.get_block_ids("r0"))  # 47 tokens fill 2 blocks
    assert dummy_meta(back).block_ids_by_req["r0"] == full


@pytest.mark.usefixtures("runner")
def test_worker_side_dummy_gets_its_metadata_every_step() -> None:
    scheduler = make_scheduler("dummy")
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    loop.run()
    worker_dummy: Any = loop.worker.host.connectors["dummy"]
    loads = [detail for hook, detail in worker_dummy.calls if hook == "start_load_kv"]
    # One entry a step; r0 fills blocks in its prefill (tokens 0-46) and on token 48 (step 2), then none;
    # the last step only tells workers r0 finished.
    assert loads == [["r0"], ["r0"], [], []] and len(loop.outputs) == 4
    saves = {detail for hook, detail in worker_dummy.calls if hook == "save_kv_layer"}
    assert saves == set(harness.LAYERS)


@pytest.mark.usefixtures("runner")
def test_workers_decode_only_metadata_a_hook_reads_and_send_no_report_without_news(
    test_connectors: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's fixed cost: nothing is decoded that no worker hook reads, and an empty report is not sent."""
    import kvconn_vllm.worker as adapter_module
    from kvconn_vllm.connector import KVConnVllmMetadata

    decoded: list[str] = []
    decode = adapter_module.decode_metadata
    monkeypatch.setattr(
        adapter_module, "decode_metadata", lambda name, *args: decoded.append(name) or decode(name, *args)
    )
    tables = f"{test_connectors}:TablesConnector"  # builds metadata every step, has no worker hook
    scheduler = make_scheduler([tables, "dummy"])
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    loop.run()
    sent = [output.kv_connector_metadata for output in loop.outputs]
    busy = [meta for meta in sent if isinstance(meta, KVConnVllmMetadata)]
    assert decoded == ["dummy"] * len(busy)  # the dummy reads its metadata in start_load_kv
    assert all(tables in meta.connectors for meta in busy)
    # The last step only tells workers r0 finished: both connectors' metadata is their default, sent as names.
    assert sent[-1] == (tables, "dummy")
    opcodes = {op.name for op, _, _ in pickletools.genops(pickle.dumps(sent[-1]))}
    assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE"}  # no class to look up: vLLM pickles it each step
    worker_dummy: Any = loop.worker.host.connectors["dummy"]
    assert len([hook for hook, _ in worker_dummy.calls if hook == "start_load_kv"]) == len(sent)  # every step

    scheduler = make_scheduler(tables)
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    reports = []
    while scheduler.has_requests():
        loop.step()
        reports.append(loop.last_kv_output and loop.last_kv_output.kv_connector_worker_meta)
    assert reports == [None] * len(loop.outputs) and scheduler.connector.host.degraded_events == 0


def test_a_step_without_news_builds_nothing_and_hands_vllm_fresh_sets_each_step(test_connectors: str) -> None:
    """The usual step's short path: no outputs on the worker, the step only counted on the scheduler.

    What vLLM gets from the worker is still new each step: it keeps those sets in its own output.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.outputs import KVConnectorOutput

    scheduler = make_scheduler(f"{test_connectors}:TablesConnector")  # no worker hook, no update_connector_output
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    loop.run()
    worker = loop.worker
    first = worker.get_transfer_results({"r0"})
    first.finished_sending.add("changed by vLLM")
    first.failed_recving.add("changed by vLLM")
    second = worker.get_transfer_results(set())
    assert first is not second and second == KVConnectorTransferResults()
    assert worker.get_block_ids_with_load_errors() == set() and worker.build_connector_worker_meta() is None
    host = scheduler.connector.host
    assert not host.awaits_reports and host.count_quiet_step()
    output = KVConnectorOutput(finished_sending={"stale"}, finished_recving={"stale"})
    scheduler.connector.update_connector_output(output)  # no worker metadata: nobody had news
    assert output.finished_sending is None and output.finished_recving is None
    assert host.degraded_events == 0


def test_metadata_equal_to_its_default_is_not_encoded_and_an_idle_step_goes_as_names(
    test_connectors: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh ``Metadata()``-equal value costs no encode: its workers decode the default's bytes either way."""
    from kvconn_test_connectors import HandoffMetadata

    import kvconn_vllm.scheduler as adapter_module

    name = f"{test_connectors}:HandoffConnector"
    encoded: list[Any] = []
    encode = adapter_module.encode_metadata
    monkeypatch.setattr(adapter_module, "encode_metadata", lambda n, meta: encoded.append(meta) or encode(n, meta))
    scheduler = make_scheduler(name, {"delay_free": False, "hit_tokens": 32})
    scheduler.add_request(make_request("hit0", PROMPT_47, max_tokens=4))
    loop = VllmLoop(scheduler)
    encoded.clear()  # the defaults, encoded at start-up by each side
    loop.run()
    assert [meta.loads for meta in encoded] == [{"hit0": [1, 2]}]  # only the step with a load encodes
    sent = [sent_metadata(output, name, HandoffMetadata) for output in loop.outputs]
    assert sent[0].loads == {"hit0": [1, 2]} and all(meta == HandoffMetadata() for meta in sent[1:])
    assert isinstance(loop.outputs[-1].kv_connector_metadata, tuple)  # nothing in flight: names only


@pytest.mark.usefixtures("runner")
def test_a_connector_without_default_metadata_sends_it_every_step(test_connectors: str) -> None:
    """Only a ``Metadata()`` default can stand for an idle step's metadata: one with a required field always goes."""
    name = f"{test_connectors}:StepConnector"
    scheduler = make_scheduler([name, "dummy"])
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    loop.run()
    assert not any(isinstance(output.kv_connector_metadata, tuple) for output in loop.outputs)
    worker: Any = loop.worker.host.connectors[name]
    assert worker.steps == list(range(1, len(loop.outputs) + 1))


def test_a_metadata_default_that_changes_each_time_never_stands_for_an_idle_step() -> None:
    """The workers build the default themselves: it must encode the same on both sides, or the step is sent."""
    from itertools import count

    from kvconn import KVConnectorMetadata
    from kvconn_vllm.scheduler import _stable_default

    ticket = count()

    class Drifting(KVConnectorMetadata):
        n: int = msgspec.field(default_factory=lambda: next(ticket))

    class Required(KVConnectorMetadata):
        n: int

    class Empty(KVConnectorMetadata):
        blocks: list[int] = msgspec.field(default_factory=list)

    assert _stable_default("d", Drifting) is None and _stable_default("r", Required) is None
    assert _stable_default("e", Empty) == (Empty(), msgspec.msgpack.encode(Empty()))


@pytest.mark.usefixtures("runner")
def test_metadata_that_keeps_the_read_only_views_arrives_as_the_lists_vllm_scheduled(test_connectors: str) -> None:
    """Views kept as they are in metadata encode like the lists the reference engine hands out."""
    from kvconn_test_connectors import FieldsMetadata

    name = f"{test_connectors}:FieldsConnector"
    scheduler = make_scheduler(name)
    for i in range(2):
        scheduler.add_request(make_request(f"r{i}", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    loop.run()
    assert scheduler.connector.host.degraded_events == 0
    for output in loop.outputs:
        sent = sent_metadata(output, name, FieldsMetadata)
        cached = output.scheduled_cached_reqs
        assert sent == FieldsMetadata(
            list(cached.req_ids), list(cached.num_computed_tokens), dict(output.num_scheduled_tokens)
        )
    assert any(output.scheduled_cached_reqs.req_ids for output in loop.outputs)


@pytest.mark.usefixtures("runner")
def test_a_free_a_worker_never_reports_is_released_even_when_no_step_runs_a_forward(test_connectors: str) -> None:
    """The host's stall bound needs a report every step while it waits, though workers skip empty reports."""
    scheduler = make_scheduler(f"{test_connectors}:HandoffConnector", {"send_steps": 10**6}, on_error="degrade")
    scheduler.connector.host.stall_steps = 3
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=2))
    loop = VllmLoop(scheduler)
    loop.run(max_steps=20)  # after r0 finishes, only steps without a forward run: vLLM waits for the free
    assert scheduler.connector.host.degraded_events == 1
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == scheduler.kv_cache_config.num_blocks - 1


@pytest.mark.usefixtures("runner")
def test_finish_and_abort_reach_the_plugin() -> None:
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler("dummy")
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("done", list(range(20)), max_tokens=2))
    scheduler.add_request(make_request("aborted", list(range(100, 140)), max_tokens=50))
    loop.step()
    loop.step()
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    loop.run()
    dummy = scheduler.connector.host.connectors["dummy"]
    finished = [detail for hook, detail in dummy.calls if hook == "request_finished"]
    assert sorted(finished) == ["aborted", "done"]
    assert dummy.get_num_tracked_requests() == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 127


@pytest.mark.usefixtures("runner")
def test_delayed_free_waits_for_the_workers_report(test_connectors: str) -> None:
    scheduler = make_scheduler(f"{test_connectors}:HandoffConnector", {"send_steps": 2})
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("r0", list(range(40)), max_tokens=1))
    loop.step()  # prefill + the one token: finished, free delayed
    assert "r0" in scheduler.requests and scheduler.requests["r0"].is_finished()
    loop.step()  # the worker learns r0 finished; sends for 2 steps
    assert "r0" in scheduler.requests
    loop.step()
    assert "r0" not in scheduler.requests
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 127


@pytest.mark.usefixtures("runner")
def test_two_connectors_free_only_when_both_are_done(test_connectors: str) -> None:
    fast, slow = f"{test_connectors}:HandoffConnector", f"{test_connectors}:SlowHandoffConnector"
    scheduler = make_scheduler([fast, slow], {fast: {"send_steps": 1}, slow: {"send_steps": 3}})
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("r0", list(range(40)), max_tokens=1))
    loop.step()
    held_steps = 0
    while "r0" in scheduler.requests:
        loop.step()
        held_steps += 1
    assert held_steps == 3  # the slow connector's 3 steps, not the fast one's 1
    host = scheduler.connector.host
    reports = {name: [o.finished_sending for o in host.connectors[name].outputs] for name in (fast, slow)}
    assert reports[fast].count({"r0"}) == 1 and reports[slow].count({"r0"}) == 1
    assert reports[fast].index({"r0"}) < reports[slow].index({"r0"})


@pytest.mark.usefixtures("runner")
def test_failed_sync_load_is_recomputed_not_used(test_connectors: str) -> None:
    name = f"{test_connectors}:HandoffConnector"
    scheduler = make_scheduler(name, {"delay_free": False, "hit_tokens": 32, "fail_load": True}, on_error="degrade")
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("hit0", list(range(40)), max_tokens=2))
    output, _ = loop.step()
    assert output.has_sync_kv_loads
    loaded = scheduler.connector.host.connectors[name]
    assert loaded.outputs[-1].failed  # the worker side raised; the host heard of it
    # vLLM rolled the request back to the failed blocks and recomputes them.
    request = scheduler.requests["hit0"]
    assert request.num_computed_tokens == 0
    output, _ = loop.step()
    assert output.num_scheduled_tokens["hit0"] == 40
    loop.run()
    assert "hit0" not in scheduler.requests


@pytest.mark.usefixtures("runner")
@pytest.mark.usefixtures("old_vllm")
def test_fallback_tracks_live_tables_through_block_fill_and_preemption(test_connectors: str) -> None:
    # 11 usable blocks; requests growing to 5 blocks each: someone is preempted and resumed.
    name = f"{test_connectors}:TablesConnector"
    scheduler = make_scheduler(name, num_blocks=12)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", list(range(100 * i, 100 * i + 40)), max_tokens=40))
    loop = VllmLoop(scheduler)
    seen = {"block_fill": 0, "resumed": 0}
    admitted: set[str] = set()

    def check(output: Any) -> None:
        assert output.kv_connector_block_state is None
        tables = offered_tables(output, name)
        live = {r: scheduler.kv_cache_manager.get_block_ids(r) for r in output.num_scheduled_tokens}
        assert tables == live  # every scheduled request offered, with its current table
        cached = output.scheduled_cached_reqs
        seen["block_fill"] += sum(b is None for b in cached.new_block_ids)
        # vLLM's v2 model runner (the default in 0.33) resends a resumed request as a new one.
        new_ids = {r.req_id for r in output.scheduled_new_reqs}
        seen["resumed"] += len(cached.resumed_req_ids) + len(new_ids & admitted)
        admitted.update(new_ids)

    loop.run(inspect=check)
    assert scheduler.connector.connector_scheduler._tracker is not None  # the fallback really ran
    assert seen["block_fill"] > 0 and seen["resumed"] > 0
    assert len(scheduler.connector.connector_scheduler._tracker) == 0  # finished requests were dropped


def reuse_a_prefix_through(plugin: str, **options: Any) -> Any:
    """A runs to the end (its full blocks are saved); vLLM's prefix cache is emptied and the KV zeroed;
    B, with A's 64-token prefix, runs to the end. Returns B's tables (one per group), after checking that
    B's prefix came from the plugin and that every non-null block of it holds A's KV in every layer.
    """
    scheduler = make_scheduler(plugin, num_blocks=64, **options)
    loop = VllmLoop(scheduler)
    prefix = list(range(5000, 5064))  # 4 full blocks
    scheduler.add_request(make_request("a", [*prefix, 1, 2, 3], max_tokens=2))
    loop.run()
    expected = {pos: loop.token_value(prefix, pos) for pos in range(64)}
    assert scheduler.reset_prefix_cache()  # no local hit left: only the plugin can supply B's prefix
    for kv in loop.kv_caches.values():
        kv.zero_()

    scheduler.add_request(make_request("b", [*prefix, 7, 8, 9, 10], max_tokens=2))
    loop.step()
    assert scheduler.requests["b"].num_computed_tokens >= 64  # 64 matched tokens came from the plugin
    tables = scheduler.kv_cache_manager.get_block_ids("b")
    loop.run()
    for table, layers in zip(tables, loop.group_layers, strict=True):
        loaded = [pos for pos in range(64) if table[pos // 16] != NULL_BLOCK_ID]
        assert loaded, "no block of the prefix in this group"
        for layer in layers:
            kv = loop.kv_caches[layer]
            got = {pos: float(kv[table[pos // 16], 0, pos % 16, 0]) for pos in loaded}
            assert got == {pos: expected[pos] for pos in loaded}, f"{plugin}: layer {layer} did not get A's KV back"
    assert scheduler.connector.host.degraded_events == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    return tables


@pytest.mark.usefixtures("runner")
@pytest.mark.parametrize("plugin", ["offload", "mooncake"])
def test_second_request_loads_the_shared_prefix_from_the_plugin(plugin: str) -> None:
    (table,) = reuse_a_prefix_through(plugin)
    assert NULL_BLOCK_ID not in table  # one full-attention group: every prefix block was loaded


@pytest.mark.parametrize("connector", ["dummy", "offload"])
def test_shipped_plugins_pass_the_scheduler_side_checks_with_vllm_as_the_driver(connector: str) -> None:
    from kvconn.testing.conformance import run_conformance

    report = run_conformance(connector, driver="vllm", select="KV01*")
    assert report.load_error is None
    assert report.failed == 0 and report.passed >= 4, report.results
    report = run_conformance(connector, driver="vllm", select="KV0[23]*")
    assert report.failed == 0 and report.passed >= 5, report.results


def test_the_vllm_driver_catches_a_connector_that_only_reads_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from kvconn.testing.conformance import run_conformance

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "sdk" / "tests" / "conformance" / "fixtures"))
    report = run_conformance("kvconn_conformance_fixtures.broken:NewBlocksOnly", driver="vllm", select="KV011")
    assert [(r.id, r.status) for r in report.results] == [("KV011", "failed")]


def test_report_collector_counts_finished_transfers_over_all_workers() -> None:
    from kvconn import KVConnectorOutput
    from kvconn_vllm.reports import ReportCollector, WorkerReport, encode_report

    collector = ReportCollector(["a", "b"], world_size=2)

    def report(sending: set[str], invalid: frozenset[int] = frozenset()) -> bytes:
        stats = {"blocks_saved": 1, "load_failed": 0}
        out = KVConnectorOutput(finished_sending=sending, invalid_block_ids=set(invalid), stats=stats)
        return encode_report(WorkerReport({"a": out}))

    merged, _ = collector.collect([report({"r0"}, frozenset({7}))])  # rank 0 only
    assert merged["a"].finished_sending == set() and merged["a"].invalid_block_ids == {7}
    assert collector.pending() == 1
    merged, _ = collector.collect([report({"r0"}), report(set())])  # rank 1 catches up
    assert merged["a"].finished_sending == {"r0"} and merged["b"] == KVConnectorOutput()
    assert merged["a"].stats == {"blocks_saved": 2, "load_failed": 0}  # a zero counter is reported, not dropped
    assert collector.pending() == 0


def test_kvconn_validate_engine_vllm_runs_the_checks_through_vllm() -> None:
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM venv"
    result = subprocess.run(
        [kvconn, "validate", "dummy", "--engine", "vllm", "--check", "KV0[123]*", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (report,) = json.loads(result.stdout)["connectors"]
    assert report["failed"] == 0 and report["passed"] >= 9
    assert "load_error" not in report


def test_kvconn_validate_engine_vllm_prints_the_report_and_a_handful_of_lines_besides() -> None:
    """Every engine the driver builds logs vLLM's start-up warnings (about 45 lines a run): counted, shown with -v."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    kvconn = shutil.which("kvconn", path=str(Path(sys.executable).parent))
    assert kvconn is not None, "kvconn-cli is not installed in the vLLM venv"
    experimental = "Initializing KVConnectorBase_V1"

    def validate(*flags: str) -> subprocess.CompletedProcess[str]:
        args = [kvconn, "validate", "dummy", "--engine", "vllm", "--check", "KV01*", *flags]
        result = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    quiet = validate()
    assert "dummy: ok" in quiet.stdout
    lines = quiet.stderr.splitlines()
    assert len(lines) <= 4, quiet.stderr
    assert experimental not in quiet.stderr and len(lines) == len(set(lines))
    assert "-v shows them" in lines[-1]
    assert validate("-v").stderr.count(experimental) > 1  # once per engine built: everything is there with -v


@pytest.mark.usefixtures("runner")
def test_a_scheduler_only_connector_sends_workers_nothing(
    test_connectors: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    only = f"{test_connectors}:SchedulerOnlyConnector"
    scheduler = make_scheduler(["dummy", only])
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=3))
    loop = VllmLoop(scheduler)
    assert loop.worker.host.names == ["dummy"]
    with caplog.at_level(logging.WARNING, logger="kvconn.vllm"):
        loop.run()
    assert all(sent_names(o) == {"dummy"} for o in loop.outputs)
    assert all(isinstance(o.kv_connector_metadata, tuple) or not o.kv_connector_metadata.dropped for o in loop.outputs)
    adapter_warnings = [r for r in caplog.records if r.name == "kvconn.vllm"]
    assert not adapter_warnings  # no worker complains about metadata it cannot decode


@pytest.mark.usefixtures("runner")
def test_vllm_stats_hold_the_counters_and_no_private_gauges() -> None:
    """vLLM sums KV-connector stats over workers and steps: a gauge there would be multiplied."""
    scheduler = make_scheduler("offload", num_blocks=64)
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("a", [*range(5000, 5064), 1, 2, 3], max_tokens=2))
    seen: dict[str, Any] = {}
    while scheduler.has_requests():
        loop.step()
        stats = loop.last_kv_output.kv_connector_stats
        if stats is not None:
            seen = stats.aggregate(type(stats)(data=seen)).data
    # The prompt's 4 full blocks were saved; offload's pool size and store sequence number (private) are not
    # here; the step's save seconds are, apart from the counters (tests/vllm/test_telemetry.py).
    assert seen.pop("seconds").keys() == {"offload.save"}
    assert seen == {"offload.blocks_saved": 4, "offload.bytes_saved": 4 * 2 * 16 * 2 * 64 * 2}


@pytest.mark.parametrize(
    "script", [["vllm_step_overhead.py"], ["vllm_step_before_after.py", "HEAD"]], ids=lambda argv: argv[0]
)
def test_the_vllm_step_benchmarks_run(tmp_path: Any, script: list[str]) -> None:
    """Their --quick smoke runs (the main tier skips them: no vLLM there); figures finite, no timing asserted.

    The before/after script compares this checkout's HEAD with its working tree (it needs git).
    """
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    if len(script) > 1 and not (repo / ".git").exists():
        pytest.skip("vllm_step_before_after.py reads the earlier tree from git, and this is not a git checkout")
    benchmarks = repo / "benchmarks" / "studies"
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, *script, "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=benchmarks,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(math.isfinite(x) for row in rows for x in row)


def test_without_worker_reports_each_connector_gets_only_its_own_loads(test_connectors: str) -> None:
    """vLLM without worker metadata merges every connector's sets; the adapter splits them back by load."""
    from types import SimpleNamespace

    from kvconn.host.scheduler_host import _Load

    first, second = f"{test_connectors}:HandoffConnector", f"{test_connectors}:SlowHandoffConnector"
    adapter = make_scheduler([first, second]).connector
    adapter.host._loads[first]["a"] = _Load([7, 8], True, sent=True)
    adapter.host._loads[second]["b"] = _Load([9], True, sent=True)
    merged = SimpleNamespace(finished_sending={"x"}, finished_recving={"a", "b", "gone"}, invalid_block_ids={8, 9})
    outputs, failed_recving = adapter.connector_scheduler._attribute(merged)
    assert (outputs[first].finished_recving, outputs[first].invalid_block_ids) == ({"a"}, {8})
    assert (outputs[second].finished_recving, outputs[second].invalid_block_ids) == ({"b"}, {9})
    assert failed_recving == {"gone"} and outputs[first].finished_sending == outputs[second].finished_sending == {"x"}
    adapter.host.update_connector_output(outputs)
    assert adapter.host.degraded_events == 0  # before, each connector was failed for the other's report


def test_the_hosts_bounds_are_set_from_vllms_extra_config() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvconn_vllm import KVConnVllmConnector

    scheduler = make_scheduler("dummy")
    extra = scheduler.vllm_config.kv_transfer_config.kv_connector_extra_config
    extra.update(
        {"kvconn_stall_steps": 7, "kvconn_stall_s": 2.5, "kvconn_hook_budget_s": 0.5, "kvconn_max_slow_calls": 5}
    )
    adapter = KVConnVllmConnector(scheduler.vllm_config, KVConnectorRole.SCHEDULER, scheduler.kv_cache_config)
    host = adapter.host
    assert (host.stall_steps, host.stall_s, host.hook_budget_s, host.max_slow_calls) == (7, 2.5, 0.5, 5)
    del extra["kvconn_stall_s"]  # the harness's own 0 too: the host's default
    adapter = KVConnVllmConnector(scheduler.vllm_config, KVConnectorRole.SCHEDULER, scheduler.kv_cache_config)
    assert adapter.host.stall_s == DEFAULT_STALL_S > 0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("kvconn_stall_s", -1, "kvconn_stall_s must be a number of seconds >= 0 (0: bound stalls by stall_steps "
         "alone), got -1"),
        ("kvconn_stall_s", "30", "kvconn_stall_s must be a number of seconds >= 0"),
        ("kvconn_stall_steps", 0, "kvconn_stall_steps must be >= 1, got 0"),
        ("kvconn_on_error", "ignore", "kvconn_on_error must be 'degrade' or 'raise', not 'ignore'"),
    ],
)  # fmt: skip
def test_a_bad_host_option_is_refused_before_launch_naming_its_key(key: str, value: Any, message: str) -> None:
    from kvconn import ConnectorConfigError
    from kvconn_vllm.config import check_extra_config

    with pytest.raises(ConnectorConfigError) as err:
        check_extra_config({"kvconn_connector": "dummy", key: value})
    assert str(err.value).startswith(message)


@pytest.mark.usefixtures("runner")
@pytest.mark.parametrize(("seconds_per_step", "degraded"), [(0.001, False), (1.0, True)])
def test_a_save_in_flight_past_the_step_bound_is_a_stall_only_past_the_time_bound_too(
    test_connectors: str, seconds_per_step: float, degraded: bool
) -> None:
    """vLLM spins through empty steps while a save is in flight: 20 of them at 1 ms each are no stall."""
    now = [0.0]  # the host's clock, moved before each step
    scheduler = make_scheduler(f"{test_connectors}:HandoffConnector", {"send_steps": 20}, on_error="degrade")
    host = scheduler.connector.host
    host.stall_steps, host.stall_s, host.clock = 3, 5.0, lambda: now[0]
    scheduler.add_request(make_request("r0", PROMPT_47, max_tokens=2))
    loop = VllmLoop(scheduler)
    for _ in range(60):
        if not scheduler.has_requests():
            break
        now[0] += seconds_per_step
        loop.step()
    assert not scheduler.has_requests()  # the free was reported (1 ms a step), or released by the host (1 s)
    assert host.degraded_events == degraded, host.first_errors
    if degraded:
        (message,) = host.first_errors.values()
        assert "in finished_sending within 3 steps and 5 s (stall_steps, stall_s); their blocks are released" in message
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == scheduler.kv_cache_config.num_blocks - 1


def test_a_synchronous_hit_on_the_whole_prompt_leaves_vllm_a_token_to_compute(test_connectors: str) -> None:
    # vLLM's scheduler asserts num_new_tokens > 0 after a synchronous load: the adapter cuts the hit to the
    # whole blocks before the last token, as the reference engine does.
    name = f"{test_connectors}:HandoffConnector"
    scheduler = make_scheduler(name, {"delay_free": False, "hit_tokens": 64})
    size = scheduler.block_size
    loop = VllmLoop(scheduler)
    scheduler.add_request(make_request("hit0", list(range(64)), max_tokens=2))
    output, _ = loop.step()
    assert output.has_sync_kv_loads
    assert output.num_scheduled_tokens["hit0"] == 64 - (63 // size) * size  # computed: the last block's tokens
    loaded = scheduler.connector.host.connectors[name]
    loop.run()
    assert "hit0" not in scheduler.requests and loaded.finished == ["hit0"]
