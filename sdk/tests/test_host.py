"""ConnectorHost: routing across several connectors, and the error policy."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

import kvconn
from kvconn import (
    ConnectorError,
    ConnectorHost,
    ConnectorLoadError,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    LoadPlan,
)
from kvconn.host import MONITORED_CALLS, CallOutcome
from kvconn.reference import Engine, Request
from kvconn.testing import create_requests, hook_reference, memory_connector


class Named(KVConnectorMetadata):
    name: str


class Recorder(KVConnector):
    Metadata = Named

    def __init__(self, *args: Any, hits: int = 0, fail_in: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hits, self.fail_in = hits, fail_in
        self.allocs: list[int] = []
        self.seen: list[str] = []

    def _maybe_fail(self, hook: str) -> None:
        if hook == self.fail_in:
            raise RuntimeError(f"boom in {hook}")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self._maybe_fail("get_num_new_matched_tokens")
        return self.hits, False

    def update_state_after_alloc(self, num_external_tokens: int) -> None:
        self.allocs.append(num_external_tokens)

    def build_connector_meta(self) -> Named:
        self._maybe_fail("build_connector_meta")
        return Named(name=str(id(self)))

    def start_load_kv(self, metadata: Named) -> None:
        self.seen.append(metadata.name)


def scheduler_host(**connectors: Recorder) -> ConnectorHost:
    return ConnectorHost(connectors, role="scheduler")


def sched(**kwargs: Any) -> Recorder:
    return Recorder(role="scheduler", **kwargs)


def test_first_connector_with_a_hit_loads_and_the_others_get_zero() -> None:
    a, b, c = sched(hits=0), sched(hits=32), sched(hits=48)
    host = scheduler_host(a=a, b=b, c=c)
    (request,) = create_requests(1, 64)
    plan = host.get_num_new_matched_tokens(request, 0)
    assert plan == LoadPlan(32, False, "b")
    assert host.update_state_after_alloc(request, ([1, 2, 3, 4],), plan)
    assert (a.allocs, b.allocs, c.allocs) == ([0], [32], [0])
    assert host.pending_loads() == {"a": set(), "b": {"r0"}, "c": set()}


def test_metadata_is_routed_per_connector_name() -> None:
    engine = Engine([f"{__name__}:Recorder", "dummy"], num_blocks=32)
    engine.generate([[1, 2, 3] * 10], max_tokens=3)
    worker = engine.worker_host
    assert worker is not None
    recorder = worker.connectors[f"{__name__}:Recorder"]
    assert isinstance(recorder, Recorder)
    scheduler_side = engine.scheduler_host.connectors[f"{__name__}:Recorder"]  # type: ignore[union-attr]
    assert recorder.seen and set(recorder.seen) == {str(id(scheduler_side))}


def test_degrade_drops_the_failing_connectors_work_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    good, bad = sched(), sched(fail_in="build_connector_meta")
    host = scheduler_host(good=good, bad=bad)
    from kvconn.testing import create_scheduler

    scheduler = create_scheduler(None)
    scheduler.host = host
    for request in create_requests(2, 20, max_tokens=4):
        scheduler.add_request(request)
    with caplog.at_level(logging.WARNING, logger="kvconn.host"):
        outputs = [scheduler.schedule() for _ in range(3)]
    assert all(set(o.kv_connector_metadata or {}) == {"good"} for o in outputs)
    assert host.error_counts == {("bad", "build_connector_meta"): 3}
    warnings = [r for r in caplog.records if "'bad'" in r.getMessage()]
    assert len(warnings) == 1 and "build_connector_meta" in warnings[0].getMessage()


def test_raise_policy_surfaces_the_connector_name() -> None:
    host = ConnectorHost({"bad": sched(fail_in="get_num_new_matched_tokens")}, role="scheduler", on_error="raise")
    (request,) = create_requests(1, 20)
    with pytest.raises(ConnectorError, match="connector 'bad' failed in get_num_new_matched_tokens") as err:
        host.get_num_new_matched_tokens(request, 0)
    assert err.value.connector == "bad" and isinstance(err.value.__cause__, RuntimeError)


def test_a_degraded_lookup_means_recompute_not_a_crash() -> None:
    host = scheduler_host(bad=sched(hits=16, fail_in="get_num_new_matched_tokens"))
    (request,) = create_requests(1, 40)
    assert host.get_num_new_matched_tokens(request, 0) == LoadPlan(0, False, None)


def test_failed_worker_side_fails_its_loads_and_releases_its_delayed_frees() -> None:
    host = scheduler_host(a=sched(hits=16))
    request = Request("r", list(range(40)), 4, 16)
    plan = host.get_num_new_matched_tokens(request, 0)
    host.update_state_after_alloc(request, ([5, 6, 7],), plan)
    host.build_connector_meta(
        kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0), kvconn.KVConnectorBlockState(set(), dict)
    )
    host._sending["done"], host._send_steps["done"] = {"a"}, (0, 0.0)
    update = host.update_connector_output({"a": KVConnectorOutput(failed=True)})
    assert update.invalid_block_ids == {5}
    assert update.finished_sending == {"done"}


class DelaysFrees(Recorder):
    def request_finished(self) -> bool:
        return True


class Listens(Recorder):
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.seen.append("update")


def test_a_step_without_reports_is_counted_quietly_only_when_nothing_waits_on_one() -> None:
    """``count_quiet_step``: the usual step costs no update; a delayed free still gets its stall bound counted."""
    assert scheduler_host(a=sched()).count_quiet_step()
    listening = Listens(role="scheduler")
    assert not scheduler_host(a=listening).count_quiet_step()  # a connector told every step needs the update
    host = ConnectorHost({"a": DelaysFrees(role="scheduler")}, role="scheduler", stall_steps=2, stall_s=0)
    (request,) = create_requests(1, 40)
    assert host.count_quiet_step()  # counted: the stall bound below starts from this step
    assert host.request_finished(request, ([1, 2],))
    assert not host.count_quiet_step()  # the free waits on a report: the engine must update
    released = [host.update_connector_output({}).finished_sending for _ in range(3)]
    assert released == [set(), set(), {request.request_id}]  # unreported for stall_steps steps: released
    assert host.error_counts == {("a", "get_finished"): 1}
    assert host.count_quiet_step()  # nothing waits any more


class Reports(Recorder):
    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()


class FailsToLoad(Recorder):
    def start_load_kv(self, metadata: Named) -> None:
        raise RuntimeError("boom in start_load_kv")


def test_a_worker_step_without_news_returns_no_outputs_and_one_with_news_returns_every_connector() -> None:
    """``get_finished`` leaves out connectors with nothing to report: the usual step returns no outputs at all."""
    quiet = ConnectorHost({"a": Recorder(role="worker"), "b": Recorder(role="worker")}, role="worker")
    quiet.bind_connector_metadata({"a": Named(name="x")})
    assert quiet.get_finished(set()) == {}
    failing = ConnectorHost({"a": FailsToLoad(role="worker")}, role="worker")
    failing.bind_connector_metadata({"a": Named(name="x")})
    failing.start_load_kv()
    assert failing.get_finished(set()) == {"a": KVConnectorOutput(failed=True)}
    assert failing.get_finished(set()) == {}  # back to quiet the next step
    reporting = ConnectorHost({"a": Reports(role="worker"), "b": Recorder(role="worker")}, role="worker")
    assert reporting.get_finished(set()) == {"a": KVConnectorOutput(), "b": KVConnectorOutput()}


class Sleepy(Recorder):
    def build_connector_meta(self) -> Named:
        time.sleep(0.003)
        return super().build_connector_meta()


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside-another"])
def test_a_connector_alone_fails_and_stalls_exactly_as_one_beside_another(beside: bool) -> None:
    """A hook only one connector implements is called without the loop over several: the same accounting."""

    def host(**connectors: Recorder) -> ConnectorHost:
        others = {"other": sched()} if beside else {}
        return ConnectorHost({**connectors, **others}, role="scheduler", hook_budget_s=0.001, max_slow_calls=2)

    def build(on: ConnectorHost) -> dict[str, KVConnectorMetadata]:
        output = kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0)
        return on.build_connector_meta(output, kvconn.KVConnectorBlockState(set(), dict))

    lookup = host(bad=sched(hits=16, fail_in="get_num_new_matched_tokens"))
    (request,) = create_requests(1, 40)
    assert lookup.get_num_new_matched_tokens(request, 0) == LoadPlan(0, False, None)
    assert lookup.error_counts == {("bad", "get_num_new_matched_tokens"): 1}

    loader = host(bad=sched(hits=16, fail_in="build_connector_meta"))
    request = Request("r", list(range(40)), 4, 16)
    plan = loader.get_num_new_matched_tokens(request, 0)
    assert plan == LoadPlan(16, False, "bad") and loader.update_state_after_alloc(request, ([5, 6, 7],), plan)
    assert "bad" not in build(loader)
    assert loader.update_connector_output({}).invalid_block_ids == {5}  # its load never went out: recomputed
    assert loader.error_counts == {("bad", "build_connector_meta"): 1}

    slow = Sleepy(role="scheduler")
    stalled = host(slow=slow)
    assert ["slow" in build(stalled) for _ in range(3)] == [True, False, False]  # the second overrun degrades it
    assert stalled.slow_calls == {("slow", "build_connector_meta"): 2}
    assert stalled.error_counts == {("slow", "build_connector_meta"): 1}


class WatchesBlockState(Recorder):
    """Fails in ``on_block_state`` when told to; records what its ``build_connector_meta`` saw."""

    def __init__(self, *args: Any, fail_watch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_watch, self.legacy_state_seen = fail_watch, []

    def on_block_state(self) -> None:
        if self.fail_watch:
            raise RuntimeError("boom in on_block_state")

    def build_connector_meta(self, scheduler_output: kvconn.SchedulerOutput) -> Named:
        self.legacy_state_seen.append(scheduler_output.kv_connector_block_state)
        return super().build_connector_meta()


def test_a_build_after_a_failed_on_block_state_is_dropped_and_the_block_state_is_lent_for_the_call_only() -> None:
    failing, fine = WatchesBlockState(role="scheduler", fail_watch=True), WatchesBlockState(role="scheduler")
    host = scheduler_host(failing=failing, fine=fine)
    output = kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0)
    state = kvconn.KVConnectorBlockState(set(), dict)
    assert set(host.build_connector_meta(output, state)) == {"fine"}
    assert host.error_counts == {("failing", "on_block_state"): 1}
    assert failing.legacy_state_seen == fine.legacy_state_seen == [state]  # both built; the failed one's is dropped
    assert output.kv_connector_block_state is None
    failing.fail_watch = False
    assert set(host.build_connector_meta(output, state)) == {"failing", "fine"}  # a failure lasts one step


class AsyncRecorder(Recorder):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.hits, True


def test_an_async_load_failed_with_its_worker_may_still_be_reported_without_failing_the_connector_again() -> None:
    """The worker raised mid-load (its loads were recomputed); a step later it reports that load done."""
    host = scheduler_host(a=AsyncRecorder(role="scheduler", hits=16))
    request = Request("r", list(range(40)), 4, 16)
    host.update_state_after_alloc(request, ([5, 6, 7],), host.get_num_new_matched_tokens(request, 0))
    host.build_connector_meta(
        kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0), kvconn.KVConnectorBlockState(set(), dict)
    )
    failed = host.update_connector_output({"a": KVConnectorOutput(failed=True)})
    assert failed.invalid_block_ids == {5} and failed.finished_recving == {"r"}
    late = host.update_connector_output({"a": KVConnectorOutput(finished_recving={"r"})})
    assert host.degraded_events == 0 and late.finished_recving == set() and not late.invalid_block_ids
    host.update_connector_output({"a": KVConnectorOutput(finished_recving={"r"})})  # a second report: a stray
    assert host.degraded_events == 1


class SwitchesAsync(Recorder):
    load_async = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.hits, self.load_async


def test_loads_of_the_step_built_last_leave_out_a_sync_load_of_a_step_built_before_it_and_still_in_flight() -> None:
    """``loads_in_flight(built_last=True)``: what the workers act on in the step built last, even built ahead."""
    loader = SwitchesAsync(role="scheduler", hits=16)
    host = scheduler_host(a=loader)
    step = kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0), kvconn.KVConnectorBlockState(set(), dict)

    def commit(req_id: str, block_ids: list[int], load_async: bool) -> None:
        loader.load_async = load_async
        request = Request(req_id, list(range(40)), 4, 16)
        assert host.update_state_after_alloc(request, (block_ids,), host.get_num_new_matched_tokens(request, 0))

    commit("sync", [1, 2, 3], False)
    commit("async", [4, 5, 6], True)
    host.build_connector_meta(*step)
    first = {"sync": ([1], False), "async": ([4], True)}
    assert host.loads_in_flight() == host.loads_in_flight(built_last=True) == {"a": first}
    commit("next", [7, 8, 9], False)
    host.build_connector_meta(*step)  # the next step, built before the first one's report (async scheduling)
    assert host.loads_in_flight(built_last=True) == {"a": {"async": ([4], True), "next": ([7], False)}}
    assert host.loads_in_flight() == {"a": {**first, "next": ([7], False)}}
    update = host.update_connector_output({"a": KVConnectorOutput(finished_recving={"async"})})
    assert update.finished_recving == {"async"} and host.loads_in_flight() == {} and host.degraded_events == 0


def test_a_bad_report_keeps_the_delayed_frees_its_worker_may_still_be_reading() -> None:
    """Only a worker that raised has lost its sends; one that answered badly may still read the blocks."""
    host = scheduler_host(a=sched())
    host._sending["done"], host._send_steps["done"] = {"a"}, (0, 0.0)
    update = host.update_connector_output({"a": KVConnectorOutput(finished_recving={"nobody"})})
    assert host.degraded_events == 1 and update.finished_sending == set() and host._sending == {"done": {"a"}}


class Marked:
    """A connector that is not a KVConnector subclass: hooks need the marker."""

    api_version = "1.0"

    def __init__(self, config: Any, *, role: Any, context: Any) -> None:
        self.calls = 0

    @kvconn.hookimpl
    def wait_for_save(self) -> None:
        self.calls += 1

    def save_kv_layer(self) -> None:  # unmarked: not a hook implementation
        raise AssertionError("unmarked methods of plain classes are not hooks")


def test_plain_classes_implement_hooks_with_the_marker() -> None:
    host = ConnectorHost.from_names(f"{__name__}:Marked", role="worker")
    host.wait_for_save()
    host.bind_connector_metadata({})
    host.save_kv_layer("layer.0", None)
    assert host.connectors[f"{__name__}:Marked"].calls == 1  # type: ignore[attr-defined]


class Typo(KVConnector):
    @kvconn.hookimpl
    def wait_for_layer_load(self, layer: str) -> None:  # the spec's argument is layer_name
        pass


def test_hook_arguments_are_validated_against_the_specs() -> None:
    with pytest.raises(ConnectorLoadError, match="invalid hook implementation"):
        ConnectorHost({"typo": Typo(role="worker")}, role="worker")


class FlakyMemory(hook_reference.HookReferenceConnector):
    down = False

    def build_connector_meta(self, scheduler_output: Any, block_state: Any) -> Any:
        if FlakyMemory.down:
            raise RuntimeError("store unreachable")
        return super().build_connector_meta(scheduler_output, block_state)


def test_engine_recomputes_when_a_connectors_metadata_fails() -> None:
    prompt = list(range(100, 180))
    with Engine(enable_prefix_caching=False) as plain:
        expected = [plain.generate([prompt], max_tokens=6)[0] for _ in range(2)]
    with Engine(f"{__name__}:FlakyMemory", enable_prefix_caching=False) as engine:
        first = engine.generate([prompt], max_tokens=6)[0]
        FlakyMemory.down = True
        try:
            second = engine.generate([prompt], max_tokens=6)[0]
        finally:
            FlakyMemory.down = False
    assert [first, second] == expected
    assert engine.stats.failed_load_blocks > 0 and engine.stats.degraded_events > 0


class SchedulerOnly(KVConnector):
    roles = frozenset({kvconn.KVConnectorRole.SCHEDULER})
    Metadata = Named

    def build_connector_meta(self) -> Named:
        return Named(name="only")


def test_connectors_are_hosted_only_for_the_roles_they_serve() -> None:
    with Engine([f"{__name__}:SchedulerOnly", "dummy"], num_blocks=32) as engine:
        assert engine.generate([[5, 6, 7] * 10], max_tokens=2)
        assert engine.scheduler_host is not None and engine.worker_host is not None
        assert engine.scheduler_host.names == [f"{__name__}:SchedulerOnly", "dummy"]
        assert engine.worker_host.names == ["dummy"]


class LayerRecorder(KVConnector):
    """Worker side: records per-layer calls; fails in ``save_kv_layer`` on the layers named in ``fail_on``."""

    Metadata = Named

    def __init__(self, *args: Any, fail_on: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_on = fail_on
        self.calls: list[tuple[str, str]] = []

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name))

    def save_kv_layer(self, layer_name: str, metadata: Named) -> None:
        self.calls.append(("save", f"{layer_name}:{metadata.name}"))
        if layer_name in self.fail_on:
            raise RuntimeError(f"boom in {layer_name}")


def test_per_layer_hooks_skip_a_connector_for_the_rest_of_the_step_it_failed_in() -> None:
    flaky = LayerRecorder(role="worker", fail_on=("L0",))
    steady, idle = LayerRecorder(role="worker"), LayerRecorder(role="worker")
    host = ConnectorHost({"flaky": flaky, "steady": steady, "idle": idle}, role="worker")

    def step() -> dict[str, KVConnectorOutput]:
        host.bind_connector_metadata({"flaky": Named(name="f"), "steady": Named(name="s")})  # none for "idle"
        for layer in ("L0", "L1"):
            host.wait_for_layer_load(layer)
            host.save_kv_layer(layer, None)
        return host.get_finished(set())

    first = step()
    assert flaky.calls == [("wait", "L0"), ("save", "L0:f")]  # sat out L1 after failing in L0
    assert steady.calls == [("wait", "L0"), ("save", "L0:s"), ("wait", "L1"), ("save", "L1:s")]
    assert idle.calls == [("wait", "L0"), ("wait", "L1")]  # no metadata: no save, but it may still wait
    assert first["flaky"].failed and not first["steady"].failed
    flaky.fail_on, flaky.calls = (), []
    second = step()
    assert flaky.calls == [("wait", "L0"), ("save", "L0:f"), ("wait", "L1"), ("save", "L1:f")]  # back next step
    assert second == {}  # nobody failed and nobody reports: a step without news has no outputs


@pytest.mark.parametrize(
    ("env", "path", "why"),
    [
        (
            {"KVCONN_DISABLE_PLUGINS": "offload"},
            "kvconn_offload:OffloadConnector",
            "disabled by KVCONN_DISABLE_PLUGINS",
        ),
        ({"KVCONN_DISABLE_PLUGINS": "offload"}, "kvconn_offload.connector:OffloadConnector", "plugin 'offload'"),
        ({"KVCONN_PLUGINS": "dummy"}, "kvconn_offload:OffloadConnector", "not in KVCONN_PLUGINS='dummy'"),
        (
            {"KVCONN_DISABLE_PLUGINS": "kvconn.testing"},
            memory_connector.__name__ + ":MemoryConnector",
            "'kvconn.testing'",
        ),
    ],
)
def test_the_plugin_lists_apply_to_module_paths(
    env: dict[str, str], path: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    for load in (lambda: Engine(path), lambda: kvconn.load_connector(path, role="worker")):
        with pytest.raises(kvconn.ConnectorNotFoundError, match=f"{path!r} is not available") as err:
            load()
        assert why in str(err.value)


def test_an_allow_list_leaves_paths_outside_every_plugin_and_allowed_plugins_loadable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCONN_PLUGINS", "dummy")
    with Engine([f"{memory_connector.__name__}:MemoryConnector", "kvconn_dummy:DummyConnector"]) as engine:
        assert engine.generate([[1, 2, 3]], max_tokens=2)[0]


class TooSmallPool(KVConnector):
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        raise kvconn.ConnectorConfigError("invalid config for connector 'x': field 'pool_bytes': too small")


def test_a_config_error_at_register_kv_caches_is_raised_not_degraded() -> None:
    with pytest.raises(kvconn.ConnectorConfigError, match="pool_bytes"):
        Engine(f"{__name__}:TooSmallPool")


def test_a_monitor_sees_every_host_call_of_a_step_in_order_with_its_result() -> None:
    engine = Engine(f"{__name__}:Recorder", num_blocks=32)
    calls: list[tuple[str, str]] = []
    results: dict[str, Any] = {}

    def after(call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        calls.append(("after", call))
        results[call] = outcome.result

    for host in (engine.scheduler_host, engine.worker_host):
        assert host is not None
        host.add_monitor(lambda call, args: calls.append(("before", call)), after)
    engine.add_request([1, 2, 3] * 10, 1, request_id="r")
    engine.step()
    names = [call for when, call in calls if when == "before"]
    assert names == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "bind_connector_metadata",
        "start_load_kv",
        *["wait_for_layer_load", "save_kv_layer"] * 2,
        "wait_for_save",
        "get_finished",
        "update_connector_output",
        "request_finished",
    ]
    assert calls[:2] == [("before", "get_num_new_matched_tokens"), ("after", "get_num_new_matched_tokens")]
    assert results["get_num_new_matched_tokens"] == LoadPlan(0, False, None)
    assert set(results["build_connector_meta"]) == {f"{__name__}:Recorder"}
    assert results["request_finished"] is False


def test_a_monitor_sees_the_exception_of_a_call_that_raised_and_it_still_raises() -> None:
    host = ConnectorHost({"bad": sched(fail_in="get_num_new_matched_tokens")}, role="scheduler", on_error="raise")
    seen: list[CallOutcome] = []
    host.add_monitor(after=lambda call, args, outcome: seen.append(outcome))
    (request,) = create_requests(1, 20)
    with pytest.raises(ConnectorError) as err:
        host.get_num_new_matched_tokens(request, 0)
    assert len(seen) == 1 and seen[0].exception is err.value and seen[0].result is None


def test_undo_removes_a_monitor_and_a_host_without_monitors_runs_its_plain_methods() -> None:
    host = scheduler_host(a=sched(hits=16))
    calls: list[str] = []
    undo = host.add_monitor(lambda call, args: calls.append(call))
    (request,) = create_requests(1, 40)
    host.get_num_new_matched_tokens(request, 0)
    assert calls == ["get_num_new_matched_tokens"]
    assert "get_num_new_matched_tokens" in vars(host)  # the wrapper shadows the method while monitored
    undo()
    undo()  # a second undo is harmless
    host.get_num_new_matched_tokens(request, 0)
    assert calls == ["get_num_new_matched_tokens"]
    assert not set(vars(host)) & set(MONITORED_CALLS)  # back to the class's methods: nothing on the hot path


def test_several_monitors_nest_the_first_added_outermost_and_each_watches_its_calls() -> None:
    host = scheduler_host(a=sched(hits=16))
    order: list[str] = []

    def monitor(tag: str) -> tuple[Any, Any]:
        return (
            lambda call, args: order.append(f"{tag} before {call}"),
            lambda call, args, outcome: order.append(f"{tag} after {call}"),
        )

    host.add_monitor(*monitor("one"))
    undo_two = host.add_monitor(*monitor("two"))
    host.add_monitor(*monitor("three"), calls=["request_finished"])
    (request,) = create_requests(1, 40)
    host.get_num_new_matched_tokens(request, 0)
    assert order == [
        "one before get_num_new_matched_tokens",
        "two before get_num_new_matched_tokens",
        "two after get_num_new_matched_tokens",
        "one after get_num_new_matched_tokens",
    ]
    order.clear()
    undo_two()
    host.request_finished(request, ([1, 2, 3],))
    assert order == [
        "one before request_finished",
        "three before request_finished",
        "three after request_finished",
        "one after request_finished",
    ]


def test_a_monitor_whose_before_raises_still_lets_the_monitors_outside_it_see_the_call_end() -> None:
    # Nested as documented (the first added outermost): an outer monitor that saw the call begin sees it end,
    # with the inner monitor's error, or a timer or a recorder is left open for good.
    host = scheduler_host(a=sched(hits=16))
    seen: list[tuple[str, BaseException | None]] = []
    host.add_monitor(after=lambda call, args, outcome: seen.append(("outer", outcome.exception)))

    def broken(call: str, args: tuple[Any, ...]) -> None:
        raise RuntimeError("monitor bug")

    host.add_monitor(broken, lambda call, args, outcome: seen.append(("inner", outcome.exception)))
    (request,) = create_requests(1, 40)
    with pytest.raises(RuntimeError, match="monitor bug") as err:
        host.get_num_new_matched_tokens(request, 0)
    assert seen == [("outer", err.value)]  # the inner monitor never began: no after for it


def test_a_monitor_given_one_call_name_as_a_string_watches_that_call() -> None:
    # A string is one call name, not the set of its letters (an error listing '_', 'd', 'e'... otherwise).
    host = scheduler_host(a=sched(hits=16))
    seen: list[str] = []
    host.add_monitor(lambda call, args: seen.append(call), calls="request_finished")
    (request,) = create_requests(1, 40)
    host.get_num_new_matched_tokens(request, 0)
    host.request_finished(request, ([1, 2, 3],))
    assert seen == ["request_finished"]
    with pytest.raises(ValueError, match=r"cannot monitor \['no_such_call'\]"):
        host.add_monitor(calls="no_such_call")


def test_a_monitor_sees_arguments_given_by_keyword_in_order() -> None:
    host = scheduler_host(a=sched(hits=16))
    seen: list[tuple[Any, ...]] = []
    host.add_monitor(lambda call, args: seen.append(args))
    (request,) = create_requests(1, 40)
    host.get_num_new_matched_tokens(request, num_computed_tokens=0)
    assert seen == [(request, 0)]


def test_monitoring_a_call_the_host_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot monitor \['pm'\]"):
        scheduler_host().add_monitor(calls=["pm"])


def test_a_host_built_by_role_is_that_roles_class_and_a_roles_class_refuses_the_other_role() -> None:
    from kvconn.host import SchedulerHost, WorkerHost

    scheduler = ConnectorHost({"a": Recorder(role="scheduler")}, role="scheduler")
    worker = ConnectorHost.from_names(f"{__name__}:Marked", role=kvconn.KVConnectorRole.WORKER)
    assert type(scheduler) is SchedulerHost and type(worker) is WorkerHost
    assert isinstance(scheduler, ConnectorHost) and isinstance(worker, ConnectorHost)
    assert not hasattr(scheduler, "start_load_kv") and not hasattr(worker, "get_num_new_matched_tokens")
    assert (
        type(WorkerHost.from_names(f"{__name__}:Marked")) is WorkerHost and worker.role is kvconn.KVConnectorRole.WORKER
    )
    with pytest.raises(TypeError, match="role='scheduler' or role='worker'"):
        ConnectorHost({"a": Recorder(role="scheduler")})
    with pytest.raises(ValueError, match="SchedulerHost serves the scheduler role, not worker"):
        SchedulerHost({"a": Recorder(role="scheduler")}, role="worker")
