"""``kvconn.reference.simulate``: the driver: one pass of a workload, per-step samples, counters and hook failures.

How ``kvconn simulate`` times passes in rounds is tested with it (``cli/tests/test_measure.py``).
"""

from __future__ import annotations

import pytest

from kvconn import ConnectorNotFoundError
from kvconn.reference.simulate import SIMULATE_SHAPE, ConnectorSetup, check_setup, run_workload
from kvconn.reference.workloads import Workload, WorkloadRequest, make_workload

MEMORY = "kvconn.testing.memory_connector:MemoryConnector"
NO_LOCAL_CACHE = SIMULATE_SHAPE.replace(enable_prefix_caching=False)


def test_degraded_events_are_counted_in_the_result() -> None:
    workload = make_workload("shared-prefix", 2, seed=0)
    setup = ConnectorSetup((MEMORY,), {"fail_hook": "save_kv_layer"})
    run = run_workload(workload, NO_LOCAL_CACHE, setup)
    assert run.stats.degraded_events > 0
    assert run.to_dict()["degraded_events"] == run.stats.degraded_events


def test_a_turn_is_submitted_only_after_the_previous_one_finished() -> None:
    prompt = list(range(1, 70))
    workload = Workload("two turns", "", 0, [WorkloadRequest(prompt, 4), WorkloadRequest(prompt + [7] * 40, 4, 0, 0)])
    finished_when_submitted: list[int] = []

    def on_progress(label: str, finished: int, total: int) -> None:
        finished_when_submitted.append(finished)

    run = run_workload(workload, NO_LOCAL_CACHE, ConnectorSetup((MEMORY,)), on_progress=on_progress)
    # the second turn found the first turn's whole prompt saved
    assert run.stats.prompt_tokens_loaded == 64
    assert finished_when_submitted[-1] == 2


def test_a_pass_records_its_steps_tokens_and_times() -> None:
    workload = make_workload("shared-prefix", 6, seed=3)
    run = run_workload(workload, NO_LOCAL_CACHE, ConnectorSetup((MEMORY,)))
    assert run.label == MEMORY and run.connectors == (MEMORY,) and len(run.outputs) == 6 and all(run.outputs)
    assert len(run.samples) == run.steps > 0 and run.wall_s > 0 and run.cpu_s > 0 and run.connector_s > 0
    assert sum(s.prompt_tokens_loaded for s in run.samples) == run.stats.prompt_tokens_loaded > 0
    assert run.hit_rate == run.stats.prompt_tokens_loaded / workload.num_prompt_tokens
    assert "samples" not in run.to_dict() and len(run.to_dict(samples=True)["samples"]) == run.steps


def test_check_setup_loads_the_connectors_or_raises_the_sdks_error() -> None:
    check_setup(ConnectorSetup((MEMORY, "dummy")))
    with pytest.raises(ConnectorNotFoundError):
        check_setup(ConnectorSetup(("no-such",)))
