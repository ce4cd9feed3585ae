"""Both of vLLM 0.33's model runners: the scheduler output each gets, and the adapter right under both.

``VLLM_USE_V2_MODEL_RUNNER`` (the ``runner`` fixture) makes vLLM's scheduler build its output
for V1 (a resumed request in ``resumed_req_ids``, ``new_block_ids`` its whole new table) or V2
(a resumed request in ``scheduled_new_reqs`` with its whole table), and the harness drives the
worker as that runner does (``KVConnectorModelRunnerMixin``, ``ActiveKVConnector``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvconn.testing.conformance import run_conformance
from kvconn_vllm.testing.harness import RUNNER_VARIABLE, RUNNERS, VllmLoop, make_request, make_scheduler

FIXTURES = Path(__file__).parents[2] / "sdk" / "tests" / "conformance" / "fixtures"
CONTRACT = "kvconn.testing.step_contract:StepContractConnector"


def _preempting(connectors: Any, **options: Any) -> tuple[Any, VllmLoop]:
    """Four growing requests on 12 blocks: vLLM preempts and resumes them."""
    scheduler = make_scheduler(connectors, num_blocks=12, **options)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", list(range(100 * i, 100 * i + 40)), max_tokens=40))
    return scheduler, VllmLoop(scheduler)


def test_a_preempted_request_comes_back_as_the_runner_expects(runner: str) -> None:
    scheduler, loop = _preempting("dummy")
    assert loop.runner == runner and scheduler.use_v2_model_runner == (runner == "v2")
    admitted: set[str] = set()
    resumed: list[tuple[str, str]] = []

    def check(output: Any) -> None:
        live = scheduler.kv_cache_manager.get_block_ids
        for new in output.scheduled_new_reqs:
            if new.req_id in admitted:  # V2: back as a new request, with its whole table
                assert tuple(new.block_ids) == tuple(live(new.req_id))
                resumed.append(("new", new.req_id))
            admitted.add(new.req_id)
        cached = output.scheduled_cached_reqs
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:  # V1: resumed, new_block_ids the whole new table
                assert tuple(blocks) == tuple(live(req_id))
                resumed.append(("resumed", req_id))

    loop.run(inspect=check)
    assert resumed, "nothing was preempted and resumed"
    assert {kind for kind, _ in resumed} == {"resumed" if runner == "v1" else "new"}


def test_the_worker_step_contract_holds_under_the_runner_through_preemption(runner: str) -> None:
    scheduler, loop = _preempting([CONTRACT, "offload"])
    loop.run()
    assert scheduler.connector.host.degraded_events == 0 and loop.worker.host.degraded_events == 0
    contract = loop.worker.host.connectors[CONTRACT]
    assert contract.steps == len(loop.outputs)  # every step, each in the contract's order (else it raised)


@pytest.mark.parametrize(("runner", "scenario"), [("v1", "preemption"), ("v2", "two-groups")])
def test_a_table_appended_across_preemption_goes_wrong_under_v1_only(
    runner: str, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appending ``new_block_ids`` after a reset on new requests: right across preemption under V2 only.

    Under V2 it still fails KV012, later, in the sliding-window scenario (vLLM nulls blocks that
    left the window without telling anyone), never in the preemption scenario, which runs first.
    """
    monkeypatch.setenv(RUNNER_VARIABLE, RUNNERS[runner])
    monkeypatch.syspath_prepend(str(FIXTURES))
    report = run_conformance("kvconn_conformance_fixtures.broken:AccumulatedTables", driver="vllm", select="KV012")
    (result,) = report.results
    assert result.status == "failed" and result.message.startswith(f"observed in scenario {scenario!r}"), result


def test_the_worker_lets_the_connector_handle_preemptions_on_every_step_as_the_runner_does(
    runner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V1's ``GPUModelRunner.execute_model`` and V2's ``pre_forward`` (``no_forward`` goes through it) call
    ``handle_preemptions`` on every step, before the forward: a connector finishing a preempted request's stores
    there reads its blocks before the step can reuse them (the data drivers keep their bytes until the step ends)."""
    from kvconn_vllm.connector import KVConnVllmConnector

    calls: list[Any] = []
    monkeypatch.setattr(KVConnVllmConnector, "handle_preemptions", lambda self, metadata: calls.append(metadata))
    _, loop = _preempting("dummy")
    loop.run()
    assert len(calls) == len(loop.outputs) and all(calls)  # each step's metadata, as the worker got it
