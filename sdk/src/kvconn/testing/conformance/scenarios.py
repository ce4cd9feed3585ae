"""Scripted scenarios: the situations in which connectors really break.

Each scenario is a list of request arrivals and aborts plus engine options;
:func:`run_scenario` plays it through any :class:`~.driver.SchedulerDriver`
and returns a :class:`Trace` of every step for the checks to analyse.
Prompt tokens are drawn from ``[10_000, 32_000)`` so that they are never
mistaken for block ids (fewer than ``10_000`` blocks in every scenario).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...context import KVCacheGroupSpec
from ...reference.shape import EngineShape
from .diagnose import Stalled, diagnose_error, stall
from .driver import DriverFactory, DriverSpec, ScenarioUnsupported, SchedulerDriver, StepRecord
from .request_ids import RequestTags, RunTag
from .waits import IdleSteps, raise_hint

__all__ = [
    "BLOCK_FILL_CHUNK",
    "MAX_STEPS",
    "OFFERED_ONLY",
    "STANDARD",
    "TWO_GROUPS",
    "Arrival",
    "Scenario",
    "Trace",
    "prompt",
    "run_scenario",
]

TOKEN_LOW, TOKEN_HIGH = 10_000, 32_000
MAX_STEPS = 3_000
#: Steps in a row that schedule nothing before a scenario is declared stuck, once the wait bound has passed too
#: (:func:`~.waits.wait_seconds`: an idle step takes microseconds, a slow store's I/O far longer).
STALL_STEPS = 64
#: Steps after the last request ends that a scenario waits for the connector's frees, with the wait bound too.
DRAIN_STEPS = 64
TWO_GROUPS = (KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.1",), sliding_window=32))


def prompt(length: int, seed: int, prefix: tuple[int, ...] = ()) -> tuple[int, ...]:
    """``prefix`` followed by deterministic pseudo-random tokens, ``length`` in all."""
    rng = random.Random(seed)
    return prefix + tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(length - len(prefix)))


@dataclass(frozen=True)
class Arrival:
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    at_step: int = 0


@dataclass(frozen=True)
class Scenario:
    """A script. ``aborts`` are ``(step, req_id)``: abort before that step is scheduled.

    ``withhold`` are requests left out of the offered block state on every step.
    ``options`` change fields of the engine's :class:`~kvconn.reference.EngineShape`.
    """

    name: str
    description: str
    arrivals: tuple[Arrival, ...]
    aborts: tuple[tuple[int, str], ...] = ()
    withhold: frozenset[str] = frozenset()
    options: Mapping[str, Any] = field(default_factory=dict)

    def spec(self, connector: str, config: Mapping[str, Any] | None) -> DriverSpec:
        return DriverSpec(connector, config, EngineShape.from_options(**self.options))


@dataclass
class Trace:
    """What a scenario showed. ``error`` is set when it stopped early (the connector raised, or the run stalled):
    what was observed; ``fix`` then the fix for that mechanism, when the diagnosis knows one.

    The records, ``finished_calls`` and ``error`` carry the engine's request ids (``tag``'s, see
    :mod:`.request_ids`); :attr:`request_ids` are those ids too.
    """

    scenario: Scenario
    tag: RunTag
    records: list[StepRecord] = field(default_factory=list)
    error: str | None = None
    exception: Exception | None = None
    fix: str | None = None
    finished_calls: dict[str, int] = field(default_factory=dict)
    tracked: dict[str, int] = field(default_factory=dict)
    leak: str | None = None
    #: why the driver cannot run this scenario (checks using it are skipped)
    unsupported: str | None = None
    #: finished requests whose blocks were still held when the drain ended
    stuck: bool = False
    #: who still waits for what when ``stuck`` (see :func:`~.diagnose.stall`)
    stalled: Stalled | None = None
    block_size: int = 16
    num_blocks: int = 256

    @property
    def request_ids(self) -> list[str]:
        """The engine's ids of the scenario's requests, in arrival order."""
        return [self.tag.engine_id(a.req_id) for a in self.scenario.arrivals]

    def where(self) -> str:
        return f"scenario {self.scenario.name!r}"


def _requests(count: int, length: int, max_tokens: int, *, seed: int) -> tuple[Arrival, ...]:
    return tuple(Arrival(f"r{i}", prompt(length, seed + i), max_tokens) for i in range(count))


_SHARED = prompt(40, 7)

STANDARD: tuple[Scenario, ...] = (
    Scenario(
        "chunked-prefill",
        "three 70-token prompts under a 40-token budget: prefill spans several steps",
        _requests(3, 70, 3, seed=100),
        options={"max_num_batched_tokens": 40},
    ),
    Scenario(
        "decode-boundaries",
        "decodes that cross block boundaries: block-fill steps allocate no block",
        (Arrival("r0", prompt(13, 200), 40), Arrival("r1", prompt(30, 201), 20)),
    ),
    Scenario(
        "preemption",
        "a 13-block pool for four growing requests: preemption, then resume with a new table",
        _requests(4, 30, 34, seed=300),
        options={"num_blocks": 14, "enable_prefix_caching": False},
    ),
    Scenario(
        "abort",
        "aborted while waiting, aborted while running, finished, and a late arrival",
        (
            Arrival("r0", prompt(20, 400), 30),
            Arrival("r1", prompt(20, 401), 30),
            Arrival("r2", prompt(20, 402), 5),
            Arrival("r3", prompt(20, 403), 5, at_step=2),
        ),
        aborts=((0, "r1"), (3, "r0")),
    ),
    Scenario(
        "abort-while-loading",
        "r1 repeats r0's 70-token prompt (prefix caching off) and is aborted on the step after the connector was "
        "asked to load it: the engine holds the blocks of a request aborted while its async load is in flight "
        "until finished_recving reports that load",
        (Arrival("r0", prompt(70, 680), 3), Arrival("r1", prompt(70, 680), 3, at_step=5)),
        aborts=((6, "r1"),),
        options={"enable_prefix_caching": False},
    ),
    Scenario(
        "fill-step-ends",
        "r0 finishes on the step that fills its last block; r1 is aborted right after its block-fill step",
        (Arrival("r0", prompt(13, 450), 4), Arrival("r1", prompt(30, 451), 30), Arrival("r2", prompt(20, 452), 12)),
        aborts=((3, "r1"),),
    ),
    Scenario(
        "two-groups",
        "a full-attention group and a 32-token sliding-window group (null blocks, freed blocks)",
        (Arrival("r0", prompt(50, 500), 30), Arrival("r1", prompt(20, 501), 30)),
        options={"kv_cache_groups": TWO_GROUPS},
    ),
    Scenario(
        "large-blocks",
        "256-token blocks: a decode that fills a block, and a prompt chunked over two steps",
        (Arrival("r0", prompt(250, 600), 10), Arrival("r1", prompt(600, 601), 2)),
        options={"block_size": 256, "num_blocks": 16},
    ),
    Scenario(
        "repeat-after-chunks",
        "a 70-token prompt prefilled in 40-token chunks, then the same prompt again (prefix caching off): its "
        "blocks come back only through the connector",
        (Arrival("r0", prompt(70, 650), 3), Arrival("r1", prompt(70, 650), 3, at_step=8)),
        options={"max_num_batched_tokens": 40, "enable_prefix_caching": False},
    ),
    Scenario(
        "aligned-repeat",
        "a 64-token prompt (four full blocks), then the same prompt again (prefix caching off): a connector holding "
        "every block of it must leave its last token to compute",
        (Arrival("r0", prompt(64, 660), 3), Arrival("r1", prompt(64, 660), 3, at_step=6)),
        options={"enable_prefix_caching": False},
    ),
    Scenario(
        "preempted-prefill",
        "r1's block-aligned 64-token prompt, chunked beside r0 in a 6-block pool, is preempted with 45 of its tokens "
        "computed (r0 needs a block) and resumed from scratch: the engine must not die, and r1 finishes",
        (Arrival("r0", prompt(31, 670), 6), Arrival("r1", prompt(64, 671), 3, at_step=2)),
        options={"num_blocks": 7, "max_num_batched_tokens": 16, "enable_prefix_caching": False},
    ),
    Scenario(
        "shared-prefixes",
        "eight concurrent requests sharing a 40-token prefix; the later four hit the prefix cache",
        tuple(Arrival(f"r{i}", prompt(49, 700 + i, _SHARED), 6, 0 if i < 4 else 3) for i in range(8)),
    ),
)

BLOCK_FILL_CHUNK = Scenario(
    "block-fill-chunk",
    "a 48-token prompt under a 40-token budget: its second chunk (8 tokens) fills its third block and allocates none",
    (Arrival("r0", prompt(48, 850), 4),),
    options={"max_num_batched_tokens": 40},
)

OFFERED_ONLY = Scenario(
    "offered-only",
    "r1 is scheduled but never offered: get_block_ids returns None for it",
    (Arrival("r0", prompt(13, 800), 24), Arrival("r1", prompt(30, 801), 24), Arrival("r2", prompt(20, 802), 8, 2)),
    withhold=frozenset({"r1", "r2"}),
)


def run_scenario(
    factory: DriverFactory,
    scenario: Scenario,
    connector: str,
    config: Mapping[str, Any] | None,
    tag: RunTag | None = None,
) -> Trace:
    """Play ``scenario``; never raises for what the connector does (see ``Trace.error``).

    ``tag`` makes its request ids the engine's (a session's next one; ``None``: a tag of a session of its own).
    """
    spec = scenario.spec(connector, config)
    tag = tag if tag is not None else RequestTags().next_run()
    trace = Trace(scenario, tag, block_size=spec.shape.block_size, num_blocks=spec.shape.num_blocks)
    try:
        driver = factory(spec)
    except ScenarioUnsupported as exc:
        trace.unsupported = str(exc)
        return trace
    except Exception as exc:
        built = f"the engine could not be built: {type(exc).__name__}: {exc}"
        trace.error = f"the connector raised in {trace.where()}: {built}"
        trace.exception = exc
        return trace
    try:
        _play(driver, scenario, trace)
        trace.finished_calls = driver.finished_calls()
        trace.tracked = driver.num_tracked_requests()
        try:
            driver.assert_empty()
        except AssertionError as exc:
            trace.leak = str(exc)
    except Exception as exc:
        diagnosis = diagnose_error(exc, driver, f"{trace.where()}, step {len(trace.records)}", scenario.description)
        trace.error, trace.fix = diagnosis.observed, diagnosis.fix
        trace.exception = exc
        trace.finished_calls = driver.finished_calls()
    finally:
        driver.close()
    return trace


def _play(driver: SchedulerDriver, scenario: Scenario, trace: Trace) -> None:
    """The script, its requests under the engine's ids (``trace.tag``)."""
    pending = sorted(scenario.arrivals, key=lambda a: a.at_step)
    aborts = sorted(scenario.aborts)
    engine_id, withhold = trace.tag.engine_id, trace.tag.engine_ids(scenario.withhold)
    idle = IdleSteps()
    for step in range(MAX_STEPS):
        while pending and pending[0].at_step <= step:
            a = pending.pop(0)
            driver.add_request(engine_id(a.req_id), a.prompt, a.max_tokens)
        while aborts and aborts[0][0] <= step:
            driver.abort(engine_id(aborts.pop(0)[1]))
        if not pending and not driver.has_unfinished():
            break
        trace.records.append(driver.step(withhold=withhold))
        if trace.records[-1].output.total_num_scheduled_tokens or pending:
            idle.busy()
        else:
            idle.idle()
        if idle.exceeded(STALL_STEPS):
            raise stall(driver, f"nothing could be scheduled for {idle.describe()} ({raise_hint()})")
    else:
        raise stall(driver, f"requests still unfinished after {MAX_STEPS} steps")
    drain = IdleSteps()
    while driver.has_work() and not drain.exceeded(DRAIN_STEPS):
        trace.records.append(driver.step(withhold=withhold))
        drain.idle()
    trace.stuck = driver.has_work()
    if trace.stuck:
        trace.stalled = stall(driver, f"after every request ended, for {drain.describe()} ({raise_hint()})")
