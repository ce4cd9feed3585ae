"""The host's stall bound in steps and seconds: a wait is a stall only past ``stall_steps`` AND ``stall_s``.

A real engine spins through empty steps while it waits on a connector, so a
correct connector's 100 ms lookup or save may outlast the steps; the seconds
bound keeps it from being degraded. Time here is a fake clock the test moves
by a set amount before each engine step: no sleeps, no timed assertions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvconn
from kvconn import ConnectorHost, ConnectorRequest, KVConnectorOutput
from kvconn.host import DEFAULT_STALL_S, HostOptions, SchedulerHost
from kvconn.reference import Engine, Request
from kvconn.testing import create_requests, hook_reference
from kvconn.testing.conformance.waits import DEFAULT_WAIT_S

STALL_STEPS = 4
STALL_S = 1.0
PROMPT = list(range(100, 164))  # four blocks of 16
MAX_STEPS = 1_000


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PendingLookup(hook_reference.HookReferenceConnector):
    """A remote lookup in flight: a stored prefix is "ask me again" (``None``) for the first ``PENDING`` asks."""

    PENDING = 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: Counter[str] = Counter()

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> Any:
        hit = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if hit[0] and self.asked[request.request_id] < self.PENDING:
            self.asked[request.request_id] += 1
            return None, False
        return hit


class PendingSave(hook_reference.HookReferenceConnector):
    """A save in flight: delays every free, and its worker reports it ``PENDING`` worker steps after the finish."""

    PENDING = 20

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sending: Counter[str] = Counter()  # worker side: request -> steps since it finished

    def request_finished(self, request: ConnectorRequest) -> bool:
        super().request_finished(request)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str]]:
        _, recving = super().get_finished(finished_req_ids)
        self.sending.update(finished_req_ids)
        self.sending.update(list(self.sending))  # one more step for each
        sent = {req_id for req_id, steps in self.sending.items() if steps > self.PENDING}
        for req_id in sent:
            del self.sending[req_id]
        return sent or None, recving


class Stalling:
    """An engine with connector ``cls`` (a store of its own) under the bounds ``STALL_STEPS`` and ``STALL_S``, its
    scheduler host on a fake clock that moves ``seconds_per_step`` before each step."""

    def __init__(self, cls: type, seconds_per_step: float) -> None:
        self.path = f"{__name__}:{cls.__name__}"
        self.clock, self.seconds_per_step = FakeClock(), seconds_per_step
        config = {"store": f"{cls.__name__}-{id(self)}"}
        self.engine = Engine(self.path, config, enable_prefix_caching=False, stall_steps=STALL_STEPS, stall_s=STALL_S)
        assert self.engine.scheduler_host is not None
        self.host = self.engine.scheduler_host
        self.host.clock = self.clock

    def run(self) -> list[int]:
        """Run a request of ``PROMPT`` until the engine has no work left (held blocks too); its tokens."""
        request = self.engine.add_request(PROMPT, max_tokens=4)
        for _ in range(MAX_STEPS):
            if not self.engine.scheduler.has_work():
                return list(request.output_token_ids)
            self.clock.now += self.seconds_per_step
            self.engine.step()
        raise AssertionError(f"the engine still has work after {MAX_STEPS} steps")


@pytest.fixture
def stalling(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Stalling]]:
    """``stalling(cls, seconds_per_step, pending=None)``: a :class:`Stalling`, ``cls.PENDING`` set to ``pending``."""
    made: list[Stalling] = []

    def make(cls: type, seconds_per_step: float, pending: int | None = None) -> Stalling:
        if pending is not None:
            monkeypatch.setattr(cls, "PENDING", pending)
        made.append(Stalling(cls, seconds_per_step))
        return made[-1]

    yield make
    for run in made:
        run.engine.close()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    with Engine(enable_prefix_caching=False) as engine:
        return engine.generate([PROMPT], max_tokens=4)[0]


# (1 ms a step, 20 asks): past stall_steps, but 20 ms < stall_s: the engine spins while the store is slow.
# (10 s a step, stall_steps asks): past stall_s, not past the steps.
@pytest.mark.parametrize(("seconds_per_step", "pending"), [(0.001, PendingLookup.PENDING), (10.0, STALL_STEPS)])
def test_a_lookup_pending_past_one_bound_only_is_waited_for_and_its_load_lands(
    seconds_per_step: float, pending: int, expected: list[int], stalling: Callable[..., Stalling]
) -> None:
    run = stalling(PendingLookup, seconds_per_step, pending)
    assert run.run() == expected  # saves the prompt's blocks
    assert run.run() == expected  # asks again `pending` times, then loads them
    assert run.host.degraded_events == 0, run.host.first_errors
    assert run.engine.stats.prompt_tokens_loaded == 48  # the three full blocks before the last token


def test_a_lookup_pending_past_both_bounds_is_given_up_on_naming_both_and_the_request_is_computed(
    expected: list[int], stalling: Callable[..., Stalling]
) -> None:
    run = stalling(PendingLookup, 0.25)
    run.run()
    assert run.run() == expected  # past 4 asks at the 5th, past 1 s at the 6th (1.25 s)
    assert run.host.error_counts == {(run.path, "get_num_new_matched_tokens"): 1}
    message = run.host.first_errors[(run.path, "get_num_new_matched_tokens")]
    assert message.startswith("BadHookAnswer: asked to be asked again about request ")
    assert "6 times in a row, for more than 4 steps and 1 s (stall_steps, stall_s); the engine stops" in message
    assert run.engine.stats.prompt_tokens_loaded == 0  # computed, not loaded


# As for the lookup: past stall_steps only (reported 20 steps on), or past stall_s only (reported within the steps).
@pytest.mark.parametrize(("seconds_per_step", "pending"), [(0.001, PendingSave.PENDING), (10.0, STALL_STEPS)])
def test_a_delayed_free_reported_past_one_bound_only_is_held_until_reported(
    seconds_per_step: float, pending: int, expected: list[int], stalling: Callable[..., Stalling]
) -> None:
    run = stalling(PendingSave, seconds_per_step, pending)
    assert run.run() == expected  # runs until the free is reported and released
    assert run.host.degraded_events == 0, run.host.first_errors
    assert not run.engine.scheduler.held_requests
    worker = run.engine.worker_host
    assert worker is not None and not worker.connectors[run.path].sending  # reported, not given up on


def test_a_delayed_free_unreported_past_both_bounds_is_released_naming_both(
    expected: list[int], stalling: Callable[..., Stalling]
) -> None:
    run = stalling(PendingSave, 0.25)
    assert run.run() == expected  # released by the host before the worker's 20 steps
    assert run.host.error_counts == {(run.path, "get_finished"): 1}
    message = run.host.first_errors[(run.path, "get_finished")]
    assert "in finished_sending within 4 steps and 1 s (stall_steps, stall_s); their blocks are released" in message
    assert not run.engine.scheduler.held_requests


class AsyncLoader(hook_reference.HookReferenceConnector):
    """Claims 16 tokens of every request, loaded asynchronously (the scheduler side only is exercised)."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        return 16, True


def _abandoned_load(clock: FakeClock, **options: Any) -> SchedulerHost:
    """A host whose async load of ``r`` was failed in flight (its worker raised): the worker may report it later."""
    host = SchedulerHost({"a": AsyncLoader(role="scheduler")}, clock=clock, **options)
    request = Request("r", list(range(40)), 4, 16)
    host.update_state_after_alloc(request, ([5, 6, 7],), host.get_num_new_matched_tokens(request, 0))
    host.build_connector_meta(
        kvconn.SchedulerOutput(0, [], kvconn.CachedRequestData(), {}, 0), kvconn.KVConnectorBlockState(set(), dict)
    )
    failed = host.update_connector_output({"a": KVConnectorOutput(failed=True)})
    assert failed.invalid_block_ids == {5} and host.degraded_events == 0  # the worker failed, not this side
    return host


@pytest.mark.parametrize(("seconds_per_step", "stray"), [(0.001, False), (0.1, True)])
def test_an_abandoned_load_is_remembered_until_both_bounds_pass(seconds_per_step: float, stray: bool) -> None:
    """A late report of a load failed in flight is no stray until it has been unreported past both bounds."""
    clock = FakeClock()
    host = _abandoned_load(clock, stall_steps=STALL_STEPS, stall_s=STALL_S)
    for _ in range(20):  # 20 steps: past stall_steps; 20 ms or 2 s
        clock.now += seconds_per_step
        host.update_connector_output({})
    host.update_connector_output({"a": KVConnectorOutput(finished_recving={"r"})})
    assert host.degraded_events == stray  # a stray report fails the connector


def test_stall_s_zero_bounds_by_steps_alone_on_a_clock_that_never_moves() -> None:
    """``stall_s=0`` is today's step-only bound: the clock is not consulted (a coarse clock may not have moved)."""
    (request,) = create_requests(1, 40)
    host = ConnectorHost(
        {"a": PendingSave(role="scheduler")}, role="scheduler", stall_steps=2, stall_s=0, clock=FakeClock()
    )
    assert host.request_finished(request, ([1, 2],))
    released = [host.update_connector_output({}).finished_sending for _ in range(3)]
    assert released == [set(), set(), {request.request_id}]
    assert "within 2 steps (stall_steps; stall_s=0)" in host.first_errors[("a", "get_finished")]


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, "30", None])
def test_a_stall_s_that_is_not_a_finite_number_of_seconds_at_least_zero_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"stall_s must be a number of seconds >= 0 \(0: bound stalls by stall_steps"):
        HostOptions(stall_s=bad)
    with pytest.raises(ValueError, match="stall_s must be"):
        Engine("dummy", stall_s=bad)


def test_a_host_s_default_time_bound_outlasts_validates_wait_so_a_store_it_would_degrade_fails_validate_first() -> None:
    """A store slow enough to be degraded by a host on the defaults fails ``kvconn validate``'s own wait first."""
    assert ConnectorHost({}, role="scheduler").stall_s == DEFAULT_STALL_S > DEFAULT_WAIT_S
