"""KV040-KV046: what a saving and loading connector does to the generated tokens.

These need the worker side and a model: they run on the driver's data
driver (its factory's ``data_driver``, e.g. vLLM's real scheduler and
model-runner code on a model with the reference model's property), or on
the reference engine for a driver without one. First requests compute and save prefixes, later
requests sharing them (their local blocks gone: prefix caching is off) must
load them through the connector, and every token must equal a run without
the connector. The reference model's next token depends on the KV it reads,
so a wrong, stale or missing block changes the output. Every freed block is
overwritten at once, so a save or load that touches a block it should not
leaves garbage, not a lucky leftover copy of the right KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ....reference import Engine, EngineShape
from ..catalog import IMPORTED, check
from ..diagnose import Diagnosis, capture_warnings, diagnose_error, explain_wrong_kv, stall, store_trouble
from ..driver import DataDriver, DriverSpec, ScenarioUnsupported, StepRecord
from ..failures import FailureMode
from ..reference import ReferenceDriver
from ..results import CheckSkipped, ScenarioBroken, Violation
from ..scenarios import IDLE_STEP_S, MAX_STEPS, TWO_GROUPS, prompt
from ..session import Session


@dataclass(frozen=True)
class Follow:
    """A prompt: ``blocks`` full blocks of ``source``'s prompt and output, then ``suffix`` tokens of its own."""

    source: str
    blocks: int
    suffix: int


@dataclass(frozen=True)
class Req:
    req_id: str
    prompt: tuple[int, ...] | Follow
    max_tokens: int


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
FAILED_LOAD = DataRun(
    "failed-load",
    {},
    (
        (Req("a", prompt(70, 14), 3),),
        (Req("b", Follow("a", 4, 5), 4),),
        (Req("b1", Follow("a", 4, 5), 4),),
    ),
    14,
)
#: Every load of ``a``'s first block fails, as a corrupt value that stays in the store: ``b``, then ``b1``, share it.
PERSISTENT_FAILURE = DataRun(
    "persistent-failure",
    {},
    (
        (Req("a", prompt(70, 42), 3),),
        (Req("b", Follow("a", 4, 5), 4),),
        (Req("b1", Follow("a", 4, 5), 4),),
    ),
    42,
)
#: The same with a full-attention and a sliding-window group: vLLM 0.33 takes such a failure per request
#: (kvconn's adapter shows it every load as async), recomputes the whole request and asks the connector again.
PERSISTENT_FAILURE_TWO_GROUPS = replace(
    PERSISTENT_FAILURE, name="persistent-failure-two-groups", options={"kv_cache_groups": TWO_GROUPS}, seed=43
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


#: What every data check requires of the connector, and the checks it runs after (hooks named right).
DATA_CHECK: dict[str, Any] = {"requires": ("scheduler", "worker", "saves", "loads"), "after": (*IMPORTED, "KV006")}
#: The data checks beyond the plain round trip: not run when that fails already (one root cause, not five).
UNTIDY_DATA_CHECK: dict[str, Any] = {**DATA_CHECK, "after": (*IMPORTED, "KV006", "KV040")}
#: KV043 runs after KV012 (the table positions it saves from) and KV044 (a save reading freed blocks goes wrong
#: after preemption as well): each says why more precisely.
PREEMPTED_DATA_CHECK: dict[str, Any] = {**DATA_CHECK, "after": (*UNTIDY_DATA_CHECK["after"], "KV012", "KV044")}


class _Run:
    """Add requests and run them to completion; the same calls on an engine or a driver."""

    def __init__(
        self,
        add: Callable[[str, Sequence[int], int], None],
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


def _play(case: DataRun, run: _Run, generated: Callable[[str], list[int]], block_size: int) -> dict[str, list[int]]:
    prompts: dict[str, tuple[int, ...]] = {}
    for phase in case.phases:
        for index, req in enumerate(phase):
            tokens = req.prompt
            if isinstance(tokens, Follow):
                shared = (prompts[tokens.source] + tuple(generated(tokens.source)))[: tokens.blocks * block_size]
                if len(shared) < tokens.blocks * block_size:
                    raise RuntimeError(f"data run {case.name!r} is misconfigured: {tokens.source!r} is too short")
                tokens = prompt(len(shared) + tokens.suffix, case.seed + 1 + index, shared)
            prompts[req.req_id] = tokens
            run.add(req.req_id, tokens, req.max_tokens)
        run.finish()
    return {req_id: generated(req_id) for req_id in prompts}


_EXPECTED: dict[tuple[str, EngineShape], dict[str, list[int]]] = {}


def _expected(case: DataRun, shape: EngineShape) -> dict[str, list[int]]:
    """The tokens without a connector, on the reference engine with the data driver's ``shape``.

    One run per case, shape and process: the model is deterministic, and its
    tokens depend only on the prompts and the KV shape, never on the engine
    that schedules them (a data driver's model has the reference model's KV
    and sampling), so every engine is held to the same tokens.
    """
    key = (case.name, shape)
    if key not in _EXPECTED:
        _EXPECTED[key] = _baseline(case, shape)
    return _EXPECTED[key]


def _shape(case: DataRun) -> EngineShape:
    """The engine of a data run: no prefix cache (blocks are scrubbed when freed), and the case's options."""
    return EngineShape.from_options(**{"enable_prefix_caching": False, **case.options})


def _baseline(case: DataRun, shape: EngineShape) -> dict[str, list[int]]:
    engine = Engine(None, shape=shape)
    requests: dict[str, Any] = {}

    def add(req_id: str, tokens: Sequence[int], max_tokens: int) -> None:
        requests[req_id] = engine.add_request(tokens, max_tokens, request_id=req_id)

    run = _Run(add, engine.step, engine.scheduler.has_work)
    return _play(case, run, lambda r: list(requests[r].output_token_ids), engine.scheduler.block_size)


@dataclass
class DataResult:
    """What a data run showed: the tokens, the engine's stats, every step's record."""

    tokens: dict[str, list[int]]
    driver: DataDriver
    records: list[StepRecord]
    #: what was logged at WARNING or above while it ran (a connector's own store errors, say)
    warnings: list[str] = field(default_factory=list)


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
        (case, None) for case in (*ROUND_TRIPS, MID_BLOCK_CHUNKS, PREEMPTED_SAVES, FILL_STEP_ENDS)
    ]
    runs = []
    for case, fail_loads in [*cases, (FAILED_LOAD, "first"), (PERSISTENT_FAILURE, "persistent")]:
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
    that worker side runs in a process of its own (same config), where a store in process memory is empty."""
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
    phase, owner, records = [0], dict[str, DataDriver](), list[StepRecord]()

    def current() -> DataDriver:
        return drivers[min(phase[0], len(drivers) - 1)]

    def add(req_id: str, tokens: Sequence[int], max_tokens: int) -> None:
        owner[req_id] = current()
        current().add_request(req_id, tokens, max_tokens)

    def next_phase() -> None:
        phase[0] += 1

    def step() -> None:
        records.append(current().step())
        if not records[-1].output.total_num_scheduled_tokens:
            # A step that schedules nothing (waiting on a load) takes microseconds: give the connector's
            # I/O threads real time, as scenarios do, before the convergence bounds call the load stuck.
            time.sleep(IDLE_STEP_S)

    warnings = capture_warnings()
    try:
        run = _Run(
            add,
            step,
            lambda: current().has_work(),
            next_phase,
            lambda what: stall(current(), what),
        )
        try:
            tokens = _play(case, run, lambda r: owner[r].generated(r), spec.shape.block_size)
            return DataResult(tokens, drivers[-1], records, warnings.messages)
        except ScenarioBroken as exc:  # the run stopped: the connector would keep the engine from finishing
            return Diagnosis(f"in data run {case.name!r}, {exc}", exc.fix)
        except Exception as exc:
            return diagnose_error(exc, current(), f"data run {case.name!r}, step {len(records)}", case.name)
    finally:
        warnings.close()
        for driver in drivers:
            driver.close()


def _compare(case: DataRun, result: DataResult, when: str = "") -> None:
    want = _expected(case, result.driver.shape)
    for req_id, tokens in want.items():
        if result.tokens[req_id] != tokens:
            seen = (
                f"in the {case.name!r} data run{when}, request {req_id!r} generated {result.tokens[req_id]}, "
                f"but {tokens} without the connector: it ran on wrong KV"
            )
            why = _why_wrong(result)
            raise Violation(f"{seen}: {why.observed}", why.fix) if why is not None else Violation(seen)


def _why_wrong(result: DataResult) -> Diagnosis | None:
    """What the run's loads landed that the model did not compute, and why (see :func:`~.diagnose.explain_wrong_kv`)."""
    driver = result.driver
    if not isinstance(driver, ReferenceDriver):  # only the reference driver audits each landed block
        return None
    groups = [spec.layer_names for spec in driver.engine.context.kv_cache_groups]
    hashes = {r: request.block_hashes for r, request in driver.requests.items()}
    return explain_wrong_kv(driver.wrong_loads, groups, result.records, hashes, driver.freed_at)


def _exact(session: Session, case: DataRun) -> bool:
    """The run loaded something, reported no failed load (none was injected), and every token is exact.

    Returns whether it loaded; without ``session.every_data_run_loads`` a run that loaded nothing is judged
    on its tokens alone.
    """
    result = data_run(session, case)
    stats = result.driver.stats
    if stats.failed_load_blocks:
        raise Violation(
            f"in the {case.name!r} data run the connector reported {stats.failed_load_blocks} block(s) failed to "
            "load though nothing failed: it claimed more tokens than it holds"
        )
    if stats.prompt_tokens_loaded == 0 and session.every_data_run_loads:
        seen = (
            f"in the {case.name!r} data run, requests sharing full blocks with earlier ones, whose local copies "
            "were gone, loaded no token through the connector"
        )
        why = store_trouble(result.records, stats.degraded_events, result.warnings)
        raise Violation(f"{seen}; {why.observed}", why.fix) if why is not None else Violation(seen)
    _compare(case, result)
    return stats.prompt_tokens_loaded > 0


@check(
    "KV040",
    "round-trip",
    fix="save each full block (every KV-cache group, every layer) on the step that fills it, keyed by its "
    "block hash; claim only the blocks you hold, and load them into the live table given to "
    "update_state_after_alloc",
    **DATA_CHECK,
)
def round_trip(session: Session) -> None:
    """A prefix saved by one request loads into another, and the tokens are exact.

    Catches connectors that load into the wrong blocks, load another
    prefix's data, miss a KV-cache group or layer, save a stale table on the
    block-fill step, or mishandle 256-token blocks and sliding-window null
    blocks; savers whose prefix never loads back at all; and connectors that
    claim more tokens than they hold (``b``'s prompt runs two full blocks past
    what was saved), whether they then skip the missing blocks silently or
    report them failed.
    """
    loaded, played = False, []
    for case in ROUND_TRIPS:
        try:
            loaded = _exact(session, case) or loaded
        except ScenarioUnsupported:
            continue
        played.append(case.name)
    if not played:
        raise CheckSkipped(f"the engine cannot play the round trips {[c.name for c in ROUND_TRIPS]}")
    if not loaded:
        raise Violation(
            f"in the round trips {played}, requests sharing full blocks with earlier ones (or their whole prompt, "
            "up to its last full block) loaded no token through the connector"
        )


@check(
    "KV041",
    "load-failure",
    fix="report every block you could not load in get_block_ids_with_load_errors, never save blocks that were "
    "loaded (or whose load failed), and after the engine rolls a request back (num_computed_tokens decreases) "
    "keep going without asserting on progress",
    **UNTIDY_DATA_CHECK,
)
def load_failure(session: Session) -> None:
    """A load reported failed is recomputed, and every token stays exact, for that request and later ones.

    The driver makes the connector's first load land garbage in its last
    block and reports that block failed to the engine, which rolls the
    request back and recomputes it. Catches connectors that crash when a
    request's computed tokens go backwards, that save the garbage they loaded
    (poisoning the store for the next request with the same prefix), and that
    lose track of the request afterwards.

    With a ``config_factory``, the connector's own store also loses data: a
    request saves, then another runs on an engine whose scheduler side sees
    that store while its worker side gets a fresh, empty namespace, so every
    block claimed is missing at load time and must be reported failed (the
    tokens stay exact). Catches loads that skip a missing block silently.
    Without a factory, or when a fresh scheduler side claims no hit (its
    store is not shared between instances), that part does not apply.
    """
    failed_load_recomputed(session)
    if session.config_factory is not None:
        _lost_blocks(session)
    else:
        _worker_elsewhere(session)


def failed_load_recomputed(session: Session) -> None:
    """KV041's first part: the connector's first load fails, is recomputed, and every token stays exact."""
    result = data_run(session, FAILED_LOAD, fail_loads="first")
    if not result.driver.injected_failure:
        raise Violation(
            f"in the {FAILED_LOAD.name!r} run the connector loaded nothing, so no load could be made to fail"
        )
    _compare(FAILED_LOAD, result, " (its first load failed)")
    tracked = {role: n for role, n in result.driver.num_tracked_requests().items() if n}
    if tracked:
        raise Violation(f"after a failed load and every request ending, get_num_tracked_requests says {tracked}")


def _in_process_state(driver: ReferenceDriver) -> bool:
    """Whether the connector declares that its sides meet only in one process (engines then keep them in one)."""
    host = driver.engine.scheduler_host
    return host is not None and any(getattr(c, "in_process_state", False) for c in host.connectors.values())


def _worker_elsewhere(session: Session) -> None:
    """Without a config factory: the second request's worker side runs in another process, with the same config.

    A store shared between processes (a server, files) still has the blocks
    there: every load succeeds. A store in process memory is empty there, as
    if it lost them: every block claimed must be reported failed, and the
    tokens stay exact. A connector whose sides meet only through process
    memory must also say so (``in_process_state``), or a multiprocess engine
    runs it with every load failing (or, with its own scheduler process, no
    hit ever).
    """
    result = data_run(session, LOST_BLOCKS, lose_blocks=True, worker_process=True)
    assert isinstance(result.driver, ReferenceDriver)  # the other process runs the reference worker
    claimed = sum(n for record in result.records for r, n in record.loaded.items() if r == "b")
    there = "its worker side in another process (as vLLM's multiprocess engine runs it)"
    if result.tokens != _expected(LOST_BLOCKS, result.driver.shape) and not result.driver.stats.failed_load_blocks:
        raise Violation(
            f"in the {LOST_BLOCKS.name!r} data run with {there}, the connector claimed {claimed} tokens for 'b', the "
            "worker side did not have them, it reported no block failed to load, and 'b' ran on wrong KV"
        )
    _compare(LOST_BLOCKS, result, f" (with {there})")
    failed = result.driver.stats.failed_load_blocks
    if claimed and failed * result.driver.block_size >= claimed and not _in_process_state(result.driver):
        raise Violation(
            f"in the {LOST_BLOCKS.name!r} data run with {there}, the connector claimed {claimed} tokens for 'b' and "
            f"every block of them failed to load ({failed}): its scheduler side finds blocks its worker side can "
            "reach only in the same process",
            "declare in_process_state = True (a property may decide it from the config): engines then refuse to run "
            "the sides in different processes, instead of running it with every load failing; or keep the store "
            "where both processes reach it (a server, shared memory, files)",
        )


def _lost_blocks(session: Session) -> None:
    """The connector's own store loses every block between the lookup and the load: each must be reported.

    Judged by the tokens, not by the failures reported: a factory whose
    "fresh" namespace still reaches the blocks lets every load succeed.
    """
    result = data_run(session, LOST_BLOCKS, lose_blocks=True)
    if result.tokens != _expected(LOST_BLOCKS, result.driver.shape) and not result.driver.stats.failed_load_blocks:
        claimed = sum(n for record in result.records for r, n in record.loaded.items() if r == "b")
        raise Violation(
            f"in the {LOST_BLOCKS.name!r} data run the connector claimed {claimed} tokens for 'b', its worker's "
            "store (a fresh namespace) had none of them, it reported no block failed to load, and 'b' ran on wrong KV"
        )
    _compare(LOST_BLOCKS, result, " (its worker's store was emptied)")


@check(
    "KV042",
    "mid-block-chunks",
    fix="save a block only once it is full: blocks below (num_computed_tokens + num_scheduled_tokens) // "
    "block_size; a prefill chunk may end in the middle of a block, which a later step completes",
    **UNTIDY_DATA_CHECK,
)
def mid_block_chunks(session: Session) -> None:
    """Chunked prefill whose chunks end mid-block saves only full blocks, and the tokens are exact.

    Three prompts share a 24-token budget (16-token blocks), so chunks end
    anywhere in a block. Catches connectors that save every block a chunk
    touched (a half-written block saved as if full, then never saved again),
    which is invisible while every chunk ends on a block boundary.
    """
    _exact(session, MID_BLOCK_CHUNKS)


@check(
    "KV043",
    "preempted-saves",
    fix="read the table each step with block_state.get_block_ids(req_id): a request resumed after preemption "
    "has a new table (new_block_ids on resume is the whole table, not an addition to the old one)",
    **PREEMPTED_DATA_CHECK,
)
def preempted_saves(session: Session) -> None:
    """Blocks a request fills after preemption and resume are saved from its new table, and the tokens are exact.

    Four growing requests share 13 blocks: they are preempted, resume with
    new tables and fill blocks after the resume; later requests load those
    blocks. Catches connectors that keep the table they saw when a request
    was first scheduled and append ``new_block_ids``: after the resume they
    save blocks at the wrong positions, or blocks that were freed.
    """
    result = data_run(session, PREEMPTED_SAVES)
    if not any(record.preempted for record in result.records):
        raise RuntimeError("the preempted-saves data run preempted nothing: the conformance suite is misconfigured")
    _exact(session, PREEMPTED_SAVES)


@check(
    "KV044",
    "freed-blocks",
    fix="while a save still reads a request's blocks, return True from request_finished and report the "
    "request in finished_sending once the save is done: the engine reuses freed blocks at once",
    **UNTIDY_DATA_CHECK,
)
def freed_blocks(session: Session) -> None:
    """No save reads a block after it was freed: requests finishing on their block-fill step, tokens exact.

    Two requests finish on the step that fills their last block while a third
    keeps the engine busy, and every freed block is overwritten at once (as a
    busy GPU cache reuses it). Catches connectors that save after the step
    (a deferred or asynchronous save) without delaying the free: they store
    whatever reused the block, and a later request loads it.
    """
    _exact(session, FILL_STEP_ENDS)


@check(
    "KV045",
    "fresh-store",
    fix="give every run a store of its own: a namespace (or directory) from the config, and a config factory "
    "returning a fresh one per run: kvconn validate --config-factory pkg.mod:function, or in pytest override "
    "ConnectorConformance.config_factory(run)",
    **UNTIDY_DATA_CHECK,
)
def fresh_store(session: Session) -> None:
    """Nothing loads on a run's first step, before the run computed anything.

    Every data run starts with new connector instances and requests whose
    prompts no other run uses. Catches stores that outlive their instances
    (files, a server, a process-wide dict) without a namespace per run: hits
    leak from one run into the next, so a test passes or fails depending on
    what ran before it.
    """
    for case, result in data_runs(session):
        first = result.records[0] if result.records else None
        leaked = first.loaded if first is not None else {}
        if leaked:
            raise Violation(
                f"in the {case.name!r} data run, {dict(sorted(leaked.items()))} tokens were loaded on its first step, "
                "before anything was computed in it: the store kept blocks from an earlier run"
            )
