"""Fault injection: a connector failing in any hook never crashes the engine or corrupts output."""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any, ClassVar

import pytest

from kvconn import ConnectorError, ConnectorHost, HookOverBudget, KVConnectorOutput
from kvconn.hookspecs import SCHEDULER_HOOKS, WORKER_HOOKS
from kvconn.reference import Engine, RequestStatus
from kvconn.testing import assert_scheduler_empty, create_requests
from kvconn.testing import raw_hook_connector as hook_reference

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
HOOKS = sorted((SCHEDULER_HOOKS | WORKER_HOOKS) - {"shutdown", "get_num_tracked_requests"})


def workload() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(32_000) for _ in range(64)]
    return [shared + [rng.randrange(32_000) for _ in range(10 + i)] for i in range(4)]


def run_sequential(engine: Engine) -> list[list[int]]:
    return [engine.generate([p], max_tokens=8)[0] for p in workload()]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    with Engine(enable_prefix_caching=False) as engine:
        return run_sequential(engine)


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("hook", HOOKS)
def test_degrade_keeps_output_exact_and_logs_once(
    hook: str, load_async: bool, expected: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    config = {"fail_hook": hook, "load_async": load_async}
    # stall_s=0: frees delayed for saves whose metadata never went out are released by the step bound, within the run
    with (
        caplog.at_level(logging.WARNING, logger="kvconn.host"),
        Engine(MEMORY, config, enable_prefix_caching=False, stall_s=0) as engine,
    ):
        outputs = run_sequential(engine)
    assert outputs == expected
    host = engine.scheduler_host if hook in SCHEDULER_HOOKS else engine.worker_host
    assert host is not None
    assert host.error_counts[(MEMORY, hook)] >= 1
    assert engine.stats.degraded_events == host.degraded_events
    logged = [r for r in caplog.records if hook in r.getMessage() and MEMORY in r.getMessage()]
    assert len(logged) == 1
    # A connector that cannot run request_finished cannot forget its requests, nor one that cannot run
    # update_connector_output the loads and held saves whose end only that report tells it; the engine leaks nothing.
    assert_scheduler_empty(engine.scheduler, connectors=hook not in ("request_finished", "update_connector_output"))


@pytest.mark.parametrize(
    "hook", ["get_num_new_matched_tokens", "build_connector_meta", "start_load_kv", "save_kv_layer"]
)
def test_raise_policy_surfaces_the_plugin_name(hook: str) -> None:
    with Engine(MEMORY, {"fail_hook": hook}, on_error="raise") as engine, pytest.raises(ConnectorError) as err:
        run_sequential(engine)
    assert err.value.connector == MEMORY and err.value.hook == hook


def test_a_partial_load_failure_recomputes_from_the_failed_block_on(expected: list[list[int]]) -> None:
    with Engine(MEMORY, {"fail_from_block": 2}, enable_prefix_caching=False) as engine:
        outputs = run_sequential(engine)
    assert outputs == expected
    # Requests 2..4 each loaded 2 blocks; request 2 asked for 4, and recomputed the 2 that failed.
    assert engine.stats.prompt_tokens_loaded == 3 * 2 * 16
    # Request 2's 2 failed blocks (1 group), each reported once; requests 3 and 4 are not offered them again
    # (a failed block cools down), so they load their 2 good blocks and compute the rest.
    assert engine.stats.failed_load_blocks == 2 * 1
    assert engine.stats.prompt_tokens_computed == engine.stats.prompt_tokens - engine.stats.prompt_tokens_loaded


def test_unknown_finished_sends_are_ignored_with_a_warning_and_unknown_loads_degrade(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = ConnectorHost.from_names("dummy", role="scheduler")
    with caplog.at_level(logging.WARNING, logger="kvconn.host"):
        update = host.update_connector_output(
            {"dummy": KVConnectorOutput(finished_sending={"ghost"}, finished_recving={"ghost"})}
        )
    assert not update.finished_sending and not update.finished_recving
    # an abort may have given up on a send: tolerated; a load the engine never waited for is a bad answer
    assert sum("unknown send" in r.getMessage() and "ghost" in r.getMessage() for r in caplog.records) == 1
    assert host.error_counts[("dummy", "get_finished")] == 1
    assert "'ghost'" in host.first_errors[("dummy", "get_finished")]


class NeverSends(hook_reference.HookReferenceConnector):
    """Delays every free and never reports the send as finished."""

    def request_finished(self, request: Any) -> bool:
        super().request_finished(request)
        return True


def test_a_send_that_never_finishes_is_released_by_an_abort() -> None:
    with Engine(f"{__name__}:NeverSends") as engine:
        (request,) = create_requests(1, 40, max_tokens=3)
        engine.scheduler.add_request(request)
        engine.run_until_done(drain_steps=5)
        assert engine.scheduler.held_requests == {request.request_id}
        engine.scheduler.finish_requests([request.request_id])
        assert_scheduler_empty(engine.scheduler)


def test_aborting_a_request_while_its_async_load_runs_frees_after_the_load() -> None:
    prompt = workload()[0]
    with Engine(MEMORY, {"load_async": True}, enable_prefix_caching=False) as engine:
        engine.generate([prompt], max_tokens=2)
        request = engine.add_request(prompt, max_tokens=2)
        output = engine.scheduler.schedule()  # blocks allocated, load handed to the worker
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        engine.scheduler.finish_requests([request.request_id])
        assert engine.scheduler.held_requests == {request.request_id}  # the worker may still write
        engine.scheduler.update_from_output(output, engine.worker.execute_model(output))
        # the load runs on the store's thread: the blocks stay held until a step finds it done
        engine.run_until_done()
        assert_scheduler_empty(engine.scheduler)


# --------------------------------------------------------------------------- livelocks (issue 14, item 3)
# Each of these ran the engine to its step limit before (100,000 steps, then RuntimeError); the
# tests give a limit of 1,000 steps so that they fail fast without the bound.


def test_a_request_that_can_never_fit_the_pool_is_refused_at_add_request() -> None:
    with Engine(num_blocks=8) as engine:  # 7 usable blocks of 16 tokens
        with pytest.raises(ValueError, match=r"can never fit the KV cache: .* need at least 9 blocks .* holds 7"):
            engine.add_request(list(range(1, 130)), max_tokens=8)
        assert not engine.scheduler.has_work()
        assert engine.generate([list(range(1, 100))], max_tokens=8)[0]  # one that fits still runs


class AsksForever(hook_reference.HookReferenceConnector):
    """Always asks to be asked again later."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[None, bool]:
        return None, False


class NeverReportsSends(hook_reference.HookReferenceConnector):
    """Delays every free and never reports one finished."""

    def request_finished(self, request: Any) -> bool:
        super().request_finished(request)
        return True


class FailsEveryBlock(hook_reference.HookReferenceConnector):
    """Reports every block of the pool as a failed load, every step."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()
        return set(range(1, 64))


@pytest.mark.parametrize(
    ("cls", "hook"),
    [
        (AsksForever, "get_num_new_matched_tokens"),
        (NeverReportsSends, "get_finished"),
        (FailsEveryBlock, "get_block_ids_with_load_errors"),
    ],
)
def test_a_connector_that_makes_no_progress_is_degraded_and_the_engine_finishes(
    cls: type, hook: str, expected: list[list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    path = f"{__name__}:{cls.__name__}"
    # 24 blocks: held sends fill the pool after a few requests, and the engine starves without the bound
    with (
        caplog.at_level(logging.WARNING, logger="kvconn.host"),
        Engine(path, enable_prefix_caching=False, num_blocks=24, stall_steps=32, stall_s=0) as engine,
    ):
        requests = [engine.add_request(p, max_tokens=8) for p in workload() * 2]
        engine.run_until_done(max_steps=1_000)
    assert [r.output_token_ids for r in requests] == expected * 2
    host = engine.scheduler_host
    assert host is not None and host.error_counts[(path, hook)] >= 1
    assert any(path in r.getMessage() and hook in r.getMessage() for r in caplog.records)
    assert engine.stats.steps < 1_000
    assert_scheduler_empty(engine.scheduler, connectors=False)


# --------------------------------------------------------------------------- hook time budget (item 4)


class SlowSaves(hook_reference.HookReferenceConnector):
    """Its wait_for_save takes 20 ms."""

    def wait_for_save(self) -> None:
        time.sleep(0.02)


def test_a_hook_over_the_time_budget_is_warned_about_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    path = f"{__name__}:SlowSaves"
    with (
        caplog.at_level(logging.WARNING, logger="kvconn.host"),
        Engine(path, hook_budget_s=0.005, max_slow_calls=None) as engine,  # warn and count only
    ):
        engine.generate([workload()[0]], max_tokens=3)
    host = engine.worker_host
    assert host is not None
    assert host.slow_calls[(path, "wait_for_save")] == engine.stats.steps
    warned = [r.getMessage() for r in caplog.records if "hook budget" in r.getMessage()]
    assert len(warned) == 1 and path in warned[0] and "wait_for_save" in warned[0]
    assert not host.slow_calls.keys() - {(path, "wait_for_save")}


class Overruns(hook_reference.HookReferenceConnector):
    """Every call of its ``hook`` takes 30 ms (a stand-in for one that never returns), counted in ``calls``."""

    hook: ClassVar[str] = "wait_for_save"
    calls: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        work = getattr(self, self.hook)

        @functools.wraps(work)  # the hook's own arguments: the host passes those its signature names
        def overrun(*call_args: Any) -> Any:
            Overruns.calls += 1
            time.sleep(0.03)
            return work(*call_args)

        setattr(self, self.hook, overrun)

    def wait_for_save(self) -> None:
        """Its saves are synchronous: nothing to wait for (but the time it takes)."""


@pytest.mark.parametrize("hook", ["start_load_kv", "get_num_new_matched_tokens", "wait_for_save"])
def test_a_connector_over_the_budget_in_calls_in_a_row_is_degraded_for_the_rest_of_the_run(
    hook: str, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(Overruns, "hook", hook)
    monkeypatch.setattr(Overruns, "calls", 0)
    path = f"{__name__}:Overruns"
    with (
        caplog.at_level(logging.WARNING, logger="kvconn.host"),
        Engine(path, enable_prefix_caching=False, hook_budget_s=0.01, max_slow_calls=3) as engine,
    ):
        outputs = run_sequential(engine) + run_sequential(engine)
    assert outputs == expected * 2  # degraded: no more loads or saves from it, exact tokens
    assert Overruns.calls == 3 < engine.stats.steps  # later steps no longer wait on it
    host = engine.worker_host if hook in ("start_load_kv", "wait_for_save") else engine.scheduler_host
    assert host is not None and host.error_counts[(path, hook)] == 1 and host.slow_calls[(path, hook)] == 3
    (line,) = [r.getMessage() for r in caplog.records if "rest of the run" in r.getMessage()]
    assert path in line and hook in line and "3 calls in a row took longer than the hook budget of 0.01 s" in line
    assert engine.stats.degraded_events > 0
    assert_scheduler_empty(engine.scheduler, connectors=False)


def test_a_connector_over_the_budget_under_on_error_raise_raises_naming_the_hook_and_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a run that must stop (the conformance suite's) gets: the host's own verdict, typed, from the hook."""
    monkeypatch.setattr(Overruns, "hook", "wait_for_save")
    path = f"{__name__}:Overruns"
    with (
        Engine(path, enable_prefix_caching=False, hook_budget_s=0.01, max_slow_calls=3, on_error="raise") as engine,
        pytest.raises(ConnectorError, match="3 calls in a row took longer than the hook budget") as raised,
    ):
        run_sequential(engine)
    assert raised.value.connector == path and raised.value.hook == "wait_for_save"
    cause = raised.value.__cause__
    assert isinstance(cause, HookOverBudget) and isinstance(cause, TimeoutError)
    assert (cause.hook, cause.calls, cause.budget_s) == ("wait_for_save", 3, 0.01) and cause.seconds > 0.01


class SometimesSlow(hook_reference.HookReferenceConnector):
    """Every other ``wait_for_save`` takes 30 ms: slow now and then (a store's own deadline), never in a row."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves = 0

    def wait_for_save(self) -> None:
        self.saves += 1
        if self.saves % 2:
            time.sleep(0.03)


def test_a_connector_slow_now_and_then_is_only_counted() -> None:
    path = f"{__name__}:SometimesSlow"
    with Engine(path, enable_prefix_caching=False, hook_budget_s=0.01, max_slow_calls=2) as engine:
        run_sequential(engine)
    host = engine.worker_host
    assert host is not None and host.slow_calls[(path, "wait_for_save")] >= 2 and not host.error_counts
    assert engine.stats.prompt_tokens_loaded > 0  # it kept loading


# --------------------------------------------------------------------------- garbage KV (item 7)


class NanLoads(hook_reference.HookReferenceConnector):
    """Writes NaN into the blocks whose load fails (``fail_from_block``) and reports them."""

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        for kv in self.kv_caches.values():
            for block in self.failed:
                kv[block].fill_(float("nan"))


def test_nan_in_a_failed_load_never_crashes_and_is_recomputed(expected: list[list[int]]) -> None:
    with Engine(f"{__name__}:NanLoads", {"fail_from_block": 2}, enable_prefix_caching=False) as engine:
        outputs = run_sequential(engine)
    assert outputs == expected
    assert engine.stats.failed_load_blocks == 3 * 2


# --------------------------------------------------------------------------- every hook's answer is checked (item 8)


class BadAnswers(hook_reference.HookReferenceConnector):
    """Does its work, then answers ``ANSWERS[hook]`` from the hooks listed there."""

    ANSWERS: ClassVar[dict[str, Any]] = {}

    def _answer(self, hook: str, result: Any) -> Any:
        return self.ANSWERS.get(hook, result)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return self._answer(
            "get_num_new_matched_tokens", super().get_num_new_matched_tokens(request, num_computed_tokens)
        )

    def request_finished(self, request: Any) -> Any:
        return self._answer("request_finished", super().request_finished(request))

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        return self._answer("get_finished", super().get_finished(finished_req_ids))

    def get_block_ids_with_load_errors(self) -> Any:
        return self._answer("get_block_ids_with_load_errors", super().get_block_ids_with_load_errors())

    def get_kv_connector_stats(self) -> Any:
        return self._answer("get_kv_connector_stats", None)

    def get_num_tracked_requests(self) -> Any:
        return self._answer("get_num_tracked_requests", super().get_num_tracked_requests())


def _bad(hook: str, value: Any) -> type:
    """A memory connector whose ``hook`` answers ``value``, loadable by its path in this module."""
    cls = type(f"Bad_{hook}_{len(globals())}", (BadAnswers,), {"ANSWERS": {hook: value}})
    globals()[cls.__name__] = cls
    return cls


class SyncLoadReportedAsync(hook_reference.HookReferenceConnector):
    """Reports its (sync) loads in finished_recving."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str]]:
        return None, {t.req_id for t in self._reported}

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        self._reported = metadata.loads


class HitEndsInsideABlock(hook_reference.HookReferenceConnector):
    """Reports one token less than the blocks it holds: the engine would take the last block's tail as loaded."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        hit, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return max(0, hit - 1), load_async


BAD_ANSWERS = {
    "lookup-type": (_bad("get_num_new_matched_tokens", "lots"), "get_num_new_matched_tokens", "'lots'"),
    "lookup-negative": (_bad("get_num_new_matched_tokens", (-16, False)), "get_num_new_matched_tokens", "-16"),
    "lookup-partial-block": (HitEndsInsideABlock, "get_num_new_matched_tokens", "num_tokens=63"),
    "finished-not-a-pair": (_bad("get_finished", 42), "get_finished", "42"),
    "finished-ints": (_bad("get_finished", ({1}, None)), "get_finished", "1 (int)"),
    "sync-load-in-finished-recving": (SyncLoadReportedAsync, "get_finished", "finished_recving"),
    "load-errors-type": (_bad("get_block_ids_with_load_errors", "abc"), "get_block_ids_with_load_errors", "'abc'"),
    "load-errors-not-ints": (_bad("get_block_ids_with_load_errors", {"x"}), "get_block_ids_with_load_errors", "'x'"),
    "stats": (_bad("get_kv_connector_stats", {"blocks_saved": "many"}), "get_kv_connector_stats", "'many'"),
    "request-finished": (_bad("request_finished", "yes"), "request_finished", "'yes'"),
}


@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_a_bad_answer_degrades_the_connector_naming_it_the_hook_and_the_value(
    case: str, expected: list[list[int]]
) -> None:
    cls, hook, value = BAD_ANSWERS[case]
    path = f"{__name__}:{cls.__name__}"
    with Engine(path, enable_prefix_caching=False) as engine:
        outputs = run_sequential(engine)
    assert outputs == expected
    # a type is checked where the hook runs, whether a report names the connector's own loads by the scheduler
    errors = {k: v for h in (engine.scheduler_host, engine.worker_host) if h for k, v in h.first_errors.items()}
    assert value in errors[(path, hook)]
    assert engine.stats.degraded_events >= 1
    assert_scheduler_empty(engine.scheduler, connectors=False)


def test_a_bad_tracked_request_count_is_a_degraded_answer() -> None:
    path = f"{__name__}:{_bad('get_num_tracked_requests', '3').__name__}"
    host = ConnectorHost.from_names(path, role="scheduler")
    assert host.num_tracked_requests() == {}
    assert "'3'" in host.first_errors[(path, "get_num_tracked_requests")]


class DropsWork(hook_reference.HookReferenceConnector):
    """Reports one degraded event a step, as a store connector does when a put or get fails and it gives up."""

    def get_kv_connector_stats(self) -> dict[str, float]:
        return {"degraded_events": 1}


def test_work_a_connector_reports_dropping_counts_as_degraded_events() -> None:
    with Engine(f"{__name__}:DropsWork") as engine:
        engine.generate([list(range(40))], max_tokens=4)
        stats = engine.stats
        hook_failures = engine.worker_host.degraded_events + engine.scheduler_host.degraded_events  # type: ignore[union-attr]
    assert hook_failures == 0 and stats.degraded_events == stats.steps > 0
