"""Fault injection: a connector failing in any hook never crashes the engine or corrupts output."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from kvconn import ConnectorError, ConnectorHost, KVConnectorOutput
from kvconn.engine import Engine, RequestStatus
from kvconn.hookspecs import SCHEDULER_HOOKS, WORKER_HOOKS
from kvconn.testing import assert_scheduler_empty, create_requests, memory_connector

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
    with (
        caplog.at_level(logging.WARNING, logger="kvconn.host"),
        Engine(MEMORY, config, enable_prefix_caching=False) as engine,
    ):
        outputs = run_sequential(engine)
    assert outputs == expected
    host = engine.scheduler_host if hook in SCHEDULER_HOOKS else engine.worker_host
    assert host is not None
    assert host.error_counts[(MEMORY, hook)] >= 1
    assert engine.stats.degraded_events == host.degraded_events
    logged = [r for r in caplog.records if hook in r.getMessage() and MEMORY in r.getMessage()]
    assert len(logged) == 1
    # A connector that cannot run request_finished cannot forget its requests; the engine leaks nothing.
    assert_scheduler_empty(engine.scheduler, connectors=hook != "request_finished")


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
    # Requests 2..4 each had 4 blocks to load: 2 landed, 2 were recomputed.
    assert engine.stats.prompt_tokens_loaded == 3 * 2 * 16
    assert engine.stats.failed_load_blocks == 3 * 2 * 1  # 2 blocks x 1 group, each reported once
    assert engine.stats.prompt_tokens_computed == engine.stats.prompt_tokens - engine.stats.prompt_tokens_loaded


def test_reports_for_unknown_requests_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    host = ConnectorHost.from_names("dummy", role="scheduler")
    with caplog.at_level(logging.WARNING, logger="kvconn.host"):
        update = host.update_connector_output(
            {"dummy": KVConnectorOutput(finished_sending={"ghost"}, finished_recving={"ghost"})}
        )
    assert not update.finished_sending and not update.finished_recving
    assert sum("unknown" in r.getMessage() and "ghost" in r.getMessage() for r in caplog.records) == 2


class NeverSends(memory_connector.MemoryConnector):
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
        assert_scheduler_empty(engine.scheduler)
