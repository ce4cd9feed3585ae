"""Data runs: phases of requests, judged on the tokens they generate.

Beside :mod:`.scenarios` (a script of arrivals and aborts played through a
scheduler driver, judged on its steps: :class:`~.scenarios.Scenario` ->
:func:`~.scenarios.run_scenario` -> :class:`~.scenarios.Trace`), a
:class:`DataRun` needs the worker side and a model: it plays on the driver's
data driver (its factory's ``data_driver``, e.g. vLLM's real scheduler and
model-runner code on a model with the reference model's property), or on the
reference engine for a driver without one (:func:`data_run` ->
:class:`DataResult`). First requests compute and save prefixes; later
requests sharing them (their local blocks gone: prefix caching is off) must
load them through the connector, and every token must equal a run without the
connector (:func:`expected_tokens`). The reference model's next token depends
on the KV it reads, so a wrong, stale or missing block changes the output.
Every freed block is overwritten at once, so a save or load that touches a
block it should not leaves garbage, not a lucky leftover copy of the right KV.

:func:`all_runs` gives the steps of every run, scenarios and data runs, to the
checks that read them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ...reference import Engine, EngineShape
from .diagnose import Diagnosis, capture_warnings, diagnose_error, stall
from .driver import NO_KEYS, DataDriver, DriverSpec, RequestKeys, ScenarioUnsupported, StepRecord
from .fault_injection import FailureMode
from .reference_driver import ReferenceDriver
from .request_ids import RunTag
from .results import ScenarioBroken
from .scenarios import MAX_STEPS, TWO_GROUPS, prompt
from .session import Session
from .waits import IdleSteps

__all__ = [
    "BLOCK_FILL_CONTROL",
    "BLOCK_FILL_REUSE",
    "BLOCK_FILL_SETTLED",
    "FAILED_LOAD",
    "FAILED_LOAD_ELSEWHERE",
    "FAILURE_SHARED_BLOCKS",
    "FILL_STEP_ENDS",
    "ISOLATED",
    "ISOLATION",
    "TENSOR_PARALLEL",
    "LOAD_CHUNK_TOKENS",
    "LOST_BLOCKS",
    "MID_BLOCK_CHUNKS",
    "PERSISTENT_FAILURE",
    "PERSISTENT_FAILURE_TWO_GROUPS",
    "PREEMPTED_LOADS",
    "PREEMPTED_PREFILL",
    "PREEMPTED_SAVES",
    "PREFILL_PREEMPTED",
    "PREFILL_PROMPT_LEN",
    "ROUND_TRIPS",
    "DataResult",
    "DataRun",
    "Follow",
    "Req",
    "Run",
    "all_runs",
    "data_driver",
    "data_run",
    "data_runs",
    "expected_tokens",
]


@dataclass(frozen=True)
class Follow:
    """A prompt: ``blocks`` full blocks of ``source``'s prompt and output, then ``suffix`` tokens of its own."""

    source: str
    blocks: int
    suffix: int


@dataclass(frozen=True)
class Req:
    """A request of a data run; ``keys`` go into its block hashes as vLLM's extra keys."""

    req_id: str
    prompt: tuple[int, ...] | Follow
    max_tokens: int
    keys: RequestKeys = NO_KEYS


@dataclass(frozen=True)
class DataRun:
    """Phases of requests; a phase's requests run together to completion before the next phase starts.

    Prefix caching is off and every freed block is overwritten at once, so a
    request reuses another's KV only through the connector, and a save or a
    load that touches the wrong block leaves garbage where the KV should be.
    """

    name: str
    options: Mapping[str, Any]
    phases: tuple[tuple[Req, ...], ...]
    seed: int
    #: from this phase on, requests run on another engine instance (new scheduler and worker, same config,
    #: so the same store where the store outlives an instance): it never saw what the first instance did
    elsewhere_from: int | None = None
    #: seconds between one phase's end and the next phase's arrivals: time for saves a connector writes in the
    #: background to land (a lookup may count only what has landed), where a check compares what was loaded
    settle_s: float = 0.0


def _reuse(
    name: str, options: Mapping[str, Any], a: tuple[int, int], shared_blocks: int, b_suffix: int, *, seed: int
) -> DataRun:
    """``a`` (prompt length, max tokens) runs alone, then ``b``: ``shared_blocks`` of ``a``'s blocks and a suffix.

    ``a`` generates past the shared blocks' end, so the last shared block is
    filled by a decode step (a block-fill step).
    """
    phases = ((Req("a", prompt(a[0], seed), a[1]),), (Req("b", Follow("a", shared_blocks, b_suffix), 4),))
    return DataRun(name, options, phases, seed)


ROUND_TRIPS = (
    # b's prompt has two full blocks past the shared ones that nobody saved: a hit must stop at the shared ones
    _reuse("chunked-reuse", {"max_num_batched_tokens": 32}, (53, 12), shared_blocks=4, b_suffix=39, seed=11),
    _reuse("two-groups-reuse", {"kv_cache_groups": TWO_GROUPS}, (60, 6), shared_blocks=4, b_suffix=9, seed=12),
    _reuse(
        "large-blocks-reuse", {"block_size": 256, "num_blocks": 16}, (262, 8), shared_blocks=1, b_suffix=10, seed=13
    ),
)


#: The chunk a connector that saves and loads whole chunks of tokens may use (LMCache's default ``chunk_size``).
LOAD_CHUNK_TOKENS = 256
#: The full blocks ``b`` and ``b1`` share with ``a`` in the load-failure runs: more than one
#: :data:`LOAD_CHUNK_TOKENS` chunk (at the default 16-token blocks), so a chunked connector loads something to fail.
FAILURE_SHARED_BLOCKS = LOAD_CHUNK_TOKENS // 16 + 1


def _shared_twice(name: str, seed: int) -> DataRun:
    """``a`` runs alone; then ``b``, and after it ``b1``, share its first blocks (the loads a check fails).

    The shared prefix spans more than a :data:`LOAD_CHUNK_TOKENS` chunk: a connector keyed by whole 256-token
    chunks (LMCache's) holds a hit there, where a shorter prefix would leave it nothing to load and the
    failure-injection checks nothing to fail.
    """
    share = Follow("a", FAILURE_SHARED_BLOCKS, 5)
    a = prompt(FAILURE_SHARED_BLOCKS * 16 + 6, seed)
    return DataRun(name, {}, ((Req("a", a, 3),), (Req("b", share, 4),), (Req("b1", share, 4),)), seed)


#: The connector's first load fails, once.
FAILED_LOAD = _shared_twice("failed-load", 14)
#: The same, with ``b1`` on another engine instance: what was saved after the failure, judged by one that never saw it.
FAILED_LOAD_ELSEWHERE = replace(_shared_twice("failed-load-elsewhere", 44), elsewhere_from=2)
#: Every load of ``a``'s first block fails, as a corrupt value that stays in the store: ``b``, then ``b1``, share it.
PERSISTENT_FAILURE = _shared_twice("persistent-failure", 42)
#: The same with a full-attention and a sliding-window group: vLLM 0.33 takes such a failure per request
#: (kvconn's adapter shows it every load as async), recomputes the whole request and asks the connector again.
#: Its prompts are its own (a store that outlives one run must not hold ``persistent-failure``'s prefix for it).
PERSISTENT_FAILURE_TWO_GROUPS = replace(
    _shared_twice("persistent-failure-two-groups", 43), options={"kv_cache_groups": TWO_GROUPS}
)
MID_BLOCK_CHUNKS = DataRun(
    "mid-block-chunks",
    {"max_num_batched_tokens": 24},
    (
        (Req("a0", prompt(70, 15), 3), Req("a1", prompt(45, 16), 3), Req("a2", prompt(37, 17), 3)),
        (Req("b0", Follow("a0", 4, 5), 3), Req("b1", Follow("a1", 2, 9), 3), Req("b2", Follow("a2", 2, 3), 3)),
    ),
    15,
)
PREEMPTED_SAVES = DataRun(
    "preempted-saves",
    {"num_blocks": 14},
    (
        tuple(Req(f"a{i}", prompt(30, 20 + i), 40) for i in range(4)),
        tuple(Req(f"b{i}", Follow(f"a{i}", 4, 5), 3) for i in range(4)),
    ),
    20,
)
#: In :data:`PREEMPTED_PREFILL`, the request preempted mid-prefill, and the length of its prompt.
PREFILL_PREEMPTED, PREFILL_PROMPT_LEN = "a1", 64
#: ``a1``'s block-aligned 64-token prompt, chunked beside ``a0`` under a 24-token budget in a 6-block pool (17
#: tokens, then 23), is preempted mid-prefill (40 tokens computed: two blocks full, which the connector may have
#: saved) when both need another block, then resumes (vLLM's V1 runner: ``resumed_req_ids`` with a whole new table;
#: V2: a new request), loads what the connector holds and computes the rest in chunks that end mid-block; ``b`` then
#: loads all four of its blocks. The liveness scenario ``preempted-prefill``'s situation, judged on the tokens, with
#: prompts of its own.
PREEMPTED_PREFILL = DataRun(
    "preempted-prefill-reuse",
    {"num_blocks": 7, "max_num_batched_tokens": 24},
    (
        (Req("a0", prompt(31, 72), 6), Req(PREFILL_PREEMPTED, prompt(PREFILL_PROMPT_LEN, 73), 3)),
        (Req("b", Follow(PREFILL_PREEMPTED, PREFILL_PROMPT_LEN // 16, 5), 3),),
    ),
    70,
)
#: The requests of :data:`PREEMPTED_LOADS` that load a prefix and grow until one of them is preempted.
RELOADING = ("b0", "b1")
#: ``a0`` and ``a1`` compute 50-token prompts (three full blocks each); then ``b0`` and ``b1`` load those three
#: blocks and generate 40 tokens each in a 10-block pool. Both need a sixth block at once: one is preempted with
#: its loaded prefix and the blocks it filled since, and resumes with a new table once the other ends. vLLM asks the
#: connector again for a resumed request (``get_num_new_matched_tokens`` from 0 computed tokens), so it loads a
#: second time, into blocks that freed garbage filled (an async load is reported in ``finished_recving`` again).
PREEMPTED_LOADS = DataRun(
    "preempted-loads",
    {"num_blocks": 11},
    (
        (Req("a0", prompt(50, 80), 3), Req("a1", prompt(50, 81), 3)),
        tuple(Req(name, Follow(f"a{i}", 3, 5), 40) for i, name in enumerate(RELOADING)),
    ),
    80,
)
FILL_STEP_ENDS = DataRun(
    "fill-step-saves",
    {},
    (
        # a0 and a1 finish on the step that fills their last block; a2 keeps the engine stepping after that
        (Req("a0", prompt(13, 30), 4), Req("a1", prompt(45, 31), 4), Req("a2", prompt(20, 32), 30)),
        (Req("b0", Follow("a0", 1, 3), 3), Req("b1", Follow("a1", 3, 4), 3)),
    ),
    30,
)


LOST_BLOCKS = DataRun("lost-blocks", {}, ((Req("a", prompt(70, 40), 3),), (Req("b", Follow("a", 4, 5), 3),)), 40)


def _salt(tenant: str) -> RequestKeys:
    return RequestKeys(cache_salt=tenant)


def _adapter(name: str) -> RequestKeys:
    return RequestKeys(adapter=name)


def _isolation() -> DataRun:
    """Two tenants (``cache_salt``) and two adapters, each computing a prefix; then the other tenant, or adapter,
    runs the same tokens (``b``, ``d``: nothing to load); then the first again (``a1``, ``c1``: a hit).

    ``b`` and ``a1`` have the same prompt, and so have ``d`` and ``c1``: only the extra keys tell them apart.
    """
    salted, adapted = Follow("a", 4, 5), Follow("c", 4, 5)
    return DataRun(
        "isolation",
        {},
        (
            (Req("a", prompt(70, 50), 3, _salt("tenant-1")), Req("c", prompt(70, 51), 3, _adapter("adapter-1"))),
            (Req("b", salted, 3, _salt("tenant-2")), Req("d", adapted, 3, _adapter("adapter-2"))),
            (Req("a1", salted, 3, _salt("tenant-1")), Req("c1", adapted, 3, _adapter("adapter-1"))),
        ),
        50,
    )


#: ``a``'s 48-token prompt under a 40-token budget: its second chunk fills its third block and allocates none (as
#: the block-fill-chunk scenario), and ``a`` ends there (one token), so no later step gives a connector that acts only
#: on new blocks a second chance; ``b`` shares its three full blocks, every one of which it must be able to load.
def _block_fill_reuse(name: str, seed: int) -> DataRun:
    return DataRun(
        name,
        {"max_num_batched_tokens": 40},
        ((Req("a", prompt(48, seed), 1),), (Req("b", Follow("a", 3, 5), 3),)),
        seed,
    )


BLOCK_FILL_REUSE = _block_fill_reuse("block-fill-reuse", 61)
#: The same again with prompts of its own (a store that outlives a run holds the first one's blocks, 'b''s third
#: included), for ``b`` to arrive a while after ``a`` ends (``settle_s``, set by the check that runs it).
BLOCK_FILL_SETTLED = _block_fill_reuse("block-fill-reuse-settled", 63)
#: The same sharing with nothing special about any step: ``a``'s prompt computes in one step that allocates its three
#: blocks. What a connector claims here is what it claims when no block filled on a step that allocated none.
BLOCK_FILL_CONTROL = DataRun(
    "block-fill-control", {}, ((Req("a", prompt(48, 62), 1),), (Req("b", Follow("a", 3, 5), 3),)), 62
)
#: Two tensor-parallel ranks, each with half of the four heads and a worker side of its own, one store per run.
TENSOR_PARALLEL = _reuse(
    "tensor-parallel-reuse", {"tp_size": 2, "num_kv_heads": 4}, (53, 12), shared_blocks=4, b_suffix=9, seed=60
)
#: Tenants and adapters apart: vLLM's extra keys in the block hashes (see :func:`_isolation`).
ISOLATION = _isolation()
#: In :data:`ISOLATION`, the requests that must load nothing, and the request whose prefix they share.
ISOLATED = {"b": "a", "d": "c"}


class _Player:
    """Add requests and run them to completion; the same calls on an engine (the baseline) or a driver."""

    def __init__(
        self,
        add: Callable[[Req, Sequence[int]], None],
        step: Callable[[], object],
        busy: Callable[[], bool],
        phase_done: Callable[[], None] = lambda: None,
        stalled: Callable[[str], Exception] = RuntimeError,
    ):
        self.add, self._step, self._busy, self._phase_done, self._stalled = add, step, busy, phase_done, stalled

    def finish(self) -> None:
        for _ in range(MAX_STEPS):
            if not self._busy():
                self._phase_done()
                return
            self._step()
        raise self._stalled(f"requests still unfinished after {MAX_STEPS} steps")


def _play(case: DataRun, run: _Player, generated: Callable[[str], list[int]], block_size: int) -> dict[str, list[int]]:
    """Every phase of ``case`` through ``run``, each to completion; returns each request's generated tokens."""
    prompts: dict[str, tuple[int, ...]] = {}
    for number, phase in enumerate(case.phases, 1):
        for index, req in enumerate(phase):
            tokens = req.prompt
            if isinstance(tokens, Follow):
                shared = (prompts[tokens.source] + tuple(generated(tokens.source)))[: tokens.blocks * block_size]
                if len(shared) < tokens.blocks * block_size:
                    raise RuntimeError(f"data run {case.name!r} is misconfigured: {tokens.source!r} is too short")
                tokens = prompt(len(shared) + tokens.suffix, case.seed + 1 + index, shared)
            prompts[req.req_id] = tokens
            run.add(req, tokens)
        run.finish()
        if case.settle_s and number < len(case.phases):
            time.sleep(case.settle_s)
    return {req_id: generated(req_id) for req_id in prompts}


def expected_tokens(session: Session, case: DataRun, shape: EngineShape) -> dict[str, list[int]]:
    """The tokens without a connector, on the reference engine with the data driver's ``shape``.

    One run per case and shape, kept by ``session``: the model is
    deterministic, and its tokens depend only on the prompts and the KV
    shape, never on the engine that schedules them (a data driver's model has
    the reference model's KV and sampling), so every engine is held to the
    same tokens.
    """
    return session.memo(f"expected:{case.name}:{shape!r}", lambda: _baseline(case, shape))


def _shape(case: DataRun) -> EngineShape:
    """The engine of a data run: no prefix cache (blocks are scrubbed when freed), and the case's options."""
    return EngineShape.from_options(**{"enable_prefix_caching": False, **case.options})


def _baseline(case: DataRun, shape: EngineShape) -> dict[str, list[int]]:
    engine = Engine(None, shape=shape)
    requests: dict[str, Any] = {}

    def add(req: Req, tokens: Sequence[int]) -> None:
        requests[req.req_id] = engine.add_request(tokens, req.max_tokens, req.req_id, **req.keys._asdict())

    run = _Player(add, engine.step, engine.scheduler.has_work)
    return _play(case, run, lambda r: list(requests[r].output_token_ids), engine.scheduler.block_size)


@dataclass
class DataResult:
    """What a data run showed: the tokens, the engine's stats, every step's record.

    ``tokens`` are keyed by the run's request names (``'a'``), as :func:`expected_tokens` are; the records and
    the driver carry the engine's ids (``tag``'s, see :mod:`.request_ids`).
    """

    tokens: dict[str, list[int]]
    driver: DataDriver
    records: list[StepRecord]
    tag: RunTag
    #: what was logged at WARNING or above while it ran (a connector's own store errors, say)
    warnings: list[str] = field(default_factory=list)

    def loaded(self, name: str) -> int:
        """The tokens the request named ``name`` loaded through the connector, over the run."""
        engine_id = self.tag.engine_id(name)
        return sum(record.loaded.get(engine_id, 0) for record in self.records)


def data_run(
    session: Session,
    case: DataRun,
    *,
    fail_loads: FailureMode | None = None,
    lose_blocks: bool = False,
    worker_process: bool = False,
) -> DataResult:
    """``case`` through the data driver with the connector, once per session; raises :class:`ScenarioBroken`.

    ``lose_blocks`` and ``worker_process``: see :func:`_with_connector`. Raises
    :class:`~..driver.ScenarioUnsupported` for a run the driver's engine cannot play.
    """
    result = session.memo(
        f"data:{case.name}:{worker_process}",
        lambda: _with_connector(session, case, fail_loads, lose_blocks, worker_process),
    )
    if isinstance(result, Diagnosis):
        raise ScenarioBroken(result.observed, result.fix)
    if isinstance(result, ScenarioUnsupported):
        raise result
    return result


def data_driver(session: Session) -> Callable[..., DataDriver]:
    """The session's driver's data driver (``factory.data_driver``), or the reference engine's."""
    found: Callable[..., DataDriver] = getattr(session.factory, "data_driver", ReferenceDriver)
    return found


def data_runs(session: Session) -> list[tuple[DataRun, DataResult]]:
    """Every data run this connector takes part in (none unless it saves and loads).

    A run in which the connector raised is left out: the data check it
    belongs to reports it, with the fix for that check.
    """
    if not {"saves", "loads"} <= session.capabilities:
        return []
    cases: list[tuple[DataRun, FailureMode | None]] = [
        (case, None)
        for case in (
            *ROUND_TRIPS,
            MID_BLOCK_CHUNKS,
            PREEMPTED_SAVES,
            PREEMPTED_PREFILL,
            PREEMPTED_LOADS,
            FILL_STEP_ENDS,
            ISOLATION,
            TENSOR_PARALLEL,
            BLOCK_FILL_REUSE,
        )
    ]
    runs = []
    failing: list[tuple[DataRun, FailureMode | None]] = [
        (FAILED_LOAD, "first"),
        (FAILED_LOAD_ELSEWHERE, "first"),
        (PERSISTENT_FAILURE, "persistent"),
    ]
    for case, fail_loads in [*cases, *failing]:
        try:
            runs.append((case, data_run(session, case, fail_loads=fail_loads)))
        except (ScenarioBroken, ScenarioUnsupported):
            continue
    return runs


class Run(NamedTuple):
    """One run's steps, for the checks that read them all: where it was, its records, its block size."""

    where: str
    records: list[StepRecord]
    block_size: int


def all_runs(session: Session) -> list[Run]:
    """Every run: the standard scenarios, then the data runs."""
    runs = [Run(trace.where(), trace.records, trace.block_size) for trace in session.completed_traces()]
    return runs + [
        Run(f"data run {case.name!r}", result.records, result.driver.block_size) for case, result in data_runs(session)
    ]


def _with_connector(
    session: Session,
    case: DataRun,
    fail_loads: FailureMode | None,
    lose_blocks: bool = False,
    worker_process: bool = False,
) -> DataResult | Diagnosis | ScenarioUnsupported:
    """Play ``case``; with ``lose_blocks`` the phases after the first run on an engine whose worker side has
    a fresh (empty) store while its scheduler side still sees the first phase's; with ``worker_process`` too,
    that worker side runs in a process of its own (same config), where a store in process memory is empty.
    A case with ``elsewhere_from`` runs its later phases on a second engine instance with the same config.
    Its requests get the engine's ids of the session's next run (:mod:`.request_ids`)."""
    tag = session.tags.next_run()
    spec = DriverSpec(session.connector, session.config_for(case.name), _shape(case))
    factory = data_driver(session)
    try:
        drivers = [factory(spec, fail_loads=fail_loads, scrub_freed=True)]
    except ScenarioUnsupported as exc:  # e.g. two KV-cache groups for a vLLM connector that is not SupportsHMA
        return exc
    if lose_blocks and worker_process:
        try:  # the other process runs the reference worker, with the first phase's KV shape (it decides the tokens)
            drivers.append(ReferenceDriver(replace(spec, shape=drivers[0].shape), worker_process=True))
        except RuntimeError as exc:  # the worker side did not start there
            drivers[0].close()
            return Diagnosis(
                f"the connector's worker side did not start in another process: {exc}",
                "make the connector importable in a new interpreter (an installed plugin or a module on "
                "PYTHONPATH) and its worker side start there from its config alone, as vLLM's workers do",
            )
    elif lose_blocks:
        emptied = session.config_for(f"{case.name}-emptied")
        drivers.append(factory(spec, scrub_freed=True, worker_config=emptied))
    elif case.elsewhere_from is not None:
        drivers.append(factory(spec, scrub_freed=True))
    phase, owner, records = [0], dict[str, DataDriver](), list[StepRecord]()
    switch = case.elsewhere_from or 1  # the phase from which the second driver, if any, runs

    def current() -> DataDriver:
        return drivers[1 if len(drivers) > 1 and phase[0] >= switch else 0]

    def add(req: Req, tokens: Sequence[int]) -> None:
        owner[req.req_id] = current()
        current().add_request(tag.engine_id(req.req_id), tokens, req.max_tokens, req.keys)

    def next_phase() -> None:
        phase[0] += 1

    idle = IdleSteps()

    def step() -> None:
        records.append(current().step())
        if records[-1].output.total_num_scheduled_tokens:
            idle.busy()
        else:  # waiting on a load: give the connector's I/O threads real time, as scenarios do
            idle.idle()

    warnings = capture_warnings()
    try:
        run = _Player(
            add,
            step,
            lambda: current().has_work(),
            next_phase,
            lambda what: stall(current(), what),
        )
        try:
            tokens = _play(case, run, lambda r: owner[r].generated(tag.engine_id(r)), spec.shape.block_size)
            return DataResult(tokens, drivers[-1], records, tag, warnings.messages)
        except ScenarioBroken as exc:  # the run stopped: the connector would keep the engine from finishing
            return Diagnosis(f"in data run {case.name!r}, {exc.observed}", exc.fix)
        except Exception as exc:
            return diagnose_error(exc, current(), f"data run {case.name!r}, step {len(records)}", case.name)
    finally:
        warnings.close()
        for driver in drivers:
            driver.close()
