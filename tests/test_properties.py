"""Property-based tests: random workloads on the reference engine with each shipped connector.

Invariants checked after every step: every scheduled request is offered in the
block state and its table resolves to the live one; each request is finished
once; `get_finished` reports each async load once, while it is in flight (a
request preempted and resumed may load again: once per load, not once per
request), and a finished send at most once per request; nothing leaks once all
requests end; generated tokens equal those of a connector-less run (an aborted
request's tokens are a prefix of them).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconn import DEFAULT_KV_CACHE_GROUPS, KVCacheGroupSpec, KVConnector, KVConnectorBlockState, SchedulerOutput
from kvconn.host import CallOutcome
from kvconn.reference import Engine
from kvconn.testing import assert_scheduler_empty

from .conftest import installed

BLOCK = 16
SPY = f"{__name__}:Spy"
CONNECTOR_CONFIGS: dict[str, dict[str, Any]] = {
    "dummy": {},
    "offload": {"pool_blocks": 64},
    "mooncake": {},
}
CONNECTORS = installed(*CONNECTOR_CONFIGS)


class Spy(KVConnector):
    """Checks the block state every step and counts request_finished calls."""

    scheduler: ClassVar[Any] = None
    finished: ClassVar[Counter[str]] = Counter()
    violations: ClassVar[list[str]] = []

    def on_block_state(self, block_state: KVConnectorBlockState, scheduler_output: SchedulerOutput) -> None:
        scheduled = set(scheduler_output.num_scheduled_tokens)
        if block_state.req_ids != scheduled:
            Spy.violations.append(f"offered {sorted(block_state.req_ids)} != scheduled {sorted(scheduled)}")
        kv = Spy.scheduler.kv_cache_manager
        for req_id in scheduled:
            if block_state.get_block_ids(req_id) != kv.get_block_ids(req_id):
                Spy.violations.append(f"stale table for {req_id}")

    def request_finished(self, request: Any) -> bool:
        Spy.finished[request.request_id] += 1
        return False


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    rng = random.Random(draw(st.integers(0, 2**16)))
    prefixes = [[rng.randrange(32_000) for _ in range(draw(st.integers(1, 5)) * BLOCK)] for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 6)) * BLOCK + draw(st.sampled_from([-1, 0, 1]))
        prefix = draw(st.sampled_from([[], *prefixes]))[:length]
        prompt = prefix + [rng.randrange(32_000) for _ in range(max(1, length - len(prefix)))]
        requests.append(
            {
                "prompt": prompt,
                "max_tokens": draw(st.integers(1, 20)),
                "arrival": draw(st.integers(0, 6)),
                "abort_at": draw(st.one_of(st.none(), st.integers(1, 12))),
            }
        )
    return {
        "requests": requests,
        "num_blocks": draw(st.integers(20, 64)),
        "max_num_batched_tokens": draw(st.sampled_from([16, 48, 256])),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_prefix_caching": draw(st.booleans()),
        "two_groups": draw(st.booleans()),
    }


def run(
    workload: dict[str, Any], connectors: list[str], config: dict[str, Any]
) -> tuple[list[list[int]], Counter[str]]:
    """Run ``workload``, checking the invariants; each request's tokens, and how often its loads were reported."""
    groups = (
        (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=32))
        if workload["two_groups"]
        else DEFAULT_KV_CACHE_GROUPS
    )
    engine = Engine(
        connectors or None,
        config,
        on_error="raise",
        num_blocks=workload["num_blocks"],
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_num_seqs=workload["max_num_seqs"],
        enable_prefix_caching=workload["enable_prefix_caching"],
        kv_cache_groups=groups,
    )
    Spy.scheduler = engine.scheduler
    sends: Counter[tuple[str, str]] = Counter()
    loads: Counter[str] = Counter()  # request -> async loads reported finished
    loading: Counter[tuple[str, str]] = Counter()  # (connector, request) -> async loads started, not yet reported
    stray_loads: list[tuple[str, str]] = []

    def count_load_starts(call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        request, _, plan = args
        if outcome.result and plan.load_async:
            loading[plan.connector, request.request_id] += 1

    def count_reports(call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        for name, out in (outcome.result or {}).items():
            sends.update((name, r) for r in out.finished_sending)
            loads.update(out.finished_recving)
            for r in out.finished_recving:
                if loading[name, r]:
                    loading[name, r] -= 1
                else:
                    stray_loads.append((name, r))

    if engine.scheduler_host is not None and engine.worker_host is not None:
        engine.scheduler_host.add_monitor(after=count_load_starts, calls=["update_state_after_alloc"])
        engine.worker_host.add_monitor(after=count_reports, calls=["get_finished"])
    pending = sorted(enumerate(workload["requests"]), key=lambda item: item[1]["arrival"])
    requests: dict[int, Any] = {}
    step = 0
    while pending or engine.scheduler.has_work():
        while pending and pending[0][1]["arrival"] <= step:
            i, spec = pending.pop(0)
            requests[i] = engine.add_request(spec["prompt"], spec["max_tokens"], request_id=f"q{i}")
        engine.abort(*(f"q{i}" for i, spec in enumerate(workload["requests"]) if spec["abort_at"] == step))
        engine.step()
        step += 1
        assert step < 5_000, "no progress"
    assert not Spy.violations, Spy.violations[:3]
    assert not stray_loads, f"finished loads that were not in flight: {stray_loads[:3]}"
    assert not +loading, f"async loads never reported finished: {(+loading).most_common(3)}"
    assert all(count == 1 for count in sends.values()), sends.most_common(3)
    assert_scheduler_empty(engine.scheduler)
    outputs = [requests[i].output_token_ids for i in range(len(workload["requests"]))]
    engine.close()
    return outputs, loads


def check(workload: dict[str, Any], connector: str, config: dict[str, Any] | None = None) -> Counter[str]:
    """``workload`` without a connector, then with ``connector`` and the spy: the invariants, and equal tokens.

    ``config`` is added to the connector's in :data:`CONNECTOR_CONFIGS`. Returns how often each request's async
    loads were reported finished.
    """
    Spy.finished.clear()
    Spy.violations.clear()
    plain = {**workload, "requests": [{**r, "abort_at": None} for r in workload["requests"]]}
    expected, _ = run(plain, [], {})
    outputs, loads = run(workload, [connector, SPY], {connector: {**CONNECTOR_CONFIGS[connector], **(config or {})}})
    assert set(Spy.finished.values()) <= {1}, Spy.finished
    assert len(Spy.finished) == len(workload["requests"])
    for got, want, spec in zip(outputs, expected, workload["requests"], strict=True):
        if spec["abort_at"] is None:
            assert got == want
        else:
            assert got == want[: len(got)]
    return loads


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _request(prompt: list[int], max_tokens: int, arrival: int) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "arrival": arrival, "abort_at": None}


#: The example that showed "reported at most once per request" was the wrong invariant: in a pool of 20 blocks
#: with a 16-token budget, q0's chunked prefill is preempted twice; each time it resumes, offload loads the blocks
#: it had saved (two async loads, two reports, exact tokens; async as on a GPU: on the reference engine's host KV
#: caches offload loads in the step by default).
RELOADED_AFTER_PREEMPTION = {
    "requests": [
        _request(list(range(1000, 1049)), 1, 1),
        _request(list(range(2000, 2081)), 10, 0),
        _request(list(range(3000, 3017)), 10, 0),
    ],
    "num_blocks": 20,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 6,
    "enable_prefix_caching": False,
    "two_groups": True,
}


#: Every connector in its default config; offload also with either load mode chosen (its default follows the KV caches).
SETUPS = [(c, {}) for c in CONNECTORS] + [
    ("offload", {"load_async": m}) for m in (True, False) if "offload" in CONNECTORS
]


@SETTINGS
@given(workload=workloads(), setup=st.sampled_from(SETUPS))
def test_random_workloads_keep_every_invariant(workload: dict[str, Any], setup: tuple[str, dict[str, Any]]) -> None:
    check(workload, *setup)


@pytest.mark.skipif("offload" not in CONNECTORS, reason="kvconn-offload is not installed")
def test_a_request_loaded_again_after_each_preemption_is_reported_once_per_load() -> None:
    loads = check(RELOADED_AFTER_PREEMPTION, "offload", {"load_async": True})
    assert loads["q0"] == 2  # the example still loads q0 twice: the invariant is checked where it matters
