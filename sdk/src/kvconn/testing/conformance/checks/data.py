"""What a saving and loading connector does to the generated tokens: the data checks.

Each plays data runs (:mod:`..runs`) with the connector and holds every
token to a run without it; a wrong token is explained, when the driver audits
the loads, by what landed where.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..catalog import IMPORTED, check
from ..diagnose import RANK_KEY_FIX, Diagnosis, explain_wrong_kv, lost_saves, store_refusals, store_trouble
from ..driver import ScenarioUnsupported, StepRecord
from ..reference_driver import ReferenceDriver
from ..results import CheckSkipped, ConformanceFailure, nothing_preempted
from ..runs import (
    FAILED_LOAD,
    FAILED_LOAD_ELSEWHERE,
    FILL_STEP_ENDS,
    ISOLATED,
    ISOLATION,
    LOST_BLOCKS,
    MID_BLOCK_CHUNKS,
    PREEMPTED_LOADS,
    PREEMPTED_PREFILL,
    PREEMPTED_SAVES,
    PREFILL_PREEMPTED,
    PREFILL_PROMPT_LEN,
    RELOADING,
    ROUND_TRIPS,
    TENSOR_PARALLEL,
    DataResult,
    DataRun,
    data_run,
    data_runs,
    expected_tokens,
)
from ..session import Session

#: What every data check requires of the connector, and the checks it runs after (hooks named right).
DATA_CHECK: dict[str, Any] = {"requires": ("scheduler", "worker", "saves", "loads"), "after": (*IMPORTED, "KV006")}
#: The data checks beyond the plain round trip: not run when that fails already (one root cause, not five).
UNTIDY_DATA_CHECK: dict[str, Any] = {**DATA_CHECK, "after": (*IMPORTED, "KV006", "KV040")}
#: KV043 runs after KV012 (the table positions it saves from), KV042 (a prompt resumed mid-prefill computes in
#: chunks that end mid-block) and KV044 (a save reading freed blocks goes wrong after preemption as well): each
#: says why more precisely.
PREEMPTED_DATA_CHECK: dict[str, Any] = {
    **DATA_CHECK,
    "after": (*UNTIDY_DATA_CHECK["after"], "KV012", "KV042", "KV044"),
}


def compare_tokens(session: Session, case: DataRun, result: DataResult, when: str = "", fix: str | None = None) -> None:
    """Every request of ``result`` generated the tokens it does without the connector (``when``: the run's setting).

    ``fix``: what to do where the run's setting is the cause, put before the fix for the mechanism diagnosed.
    """
    want = expected_tokens(session, case, result.driver.shape)
    for req_id, tokens in want.items():
        if result.tokens[req_id] != tokens:
            seen = (
                f"in the {case.name!r} data run{when}, request {req_id!r} generated {result.tokens[req_id]}, "
                f"but {tokens} without the connector: it ran on wrong KV"
            )
            why = _why_wrong(result)
            if why is None:
                raise ConformanceFailure(seen, fix)
            fixes = [f for f in (fix, why.fix) if f]
            raise ConformanceFailure(f"{seen}: {why.observed}", "; ".join(fixes) if fixes else None)


def _why_wrong(result: DataResult) -> Diagnosis | None:
    """What the run's loads landed that the model did not compute, and why (:func:`~..diagnose.explain_wrong_kv`).

    The reference driver audits each landed block; another engine's data driver may too, through an
    ``explain_wrong_kv(records)`` method of its own (the vLLM drivers have one).
    """
    driver = result.driver
    if not isinstance(driver, ReferenceDriver):
        explain = getattr(driver, "explain_wrong_kv", None)
        return explain(result.records) if explain is not None else None
    groups = [spec.layer_names for spec in driver.engine.context.kv_cache_groups]
    hashes = {r: request.block_hashes for r, request in driver.requests.items()}
    return explain_wrong_kv(driver.wrong_loads, groups, result.records, hashes, driver.freed_at)


def _exact(session: Session, case: DataRun, when: str = "", fix: str | None = None) -> bool:
    """The run loaded something, reported no failed load (none was injected), and every token is exact.

    Returns whether it loaded; without ``session.every_data_run_loads`` a run that loaded nothing is judged
    on its tokens alone. ``when`` and ``fix``: see :func:`compare_tokens`.
    """
    result = data_run(session, case)
    stats = result.driver.stats
    if stats.failed_load_blocks:
        seen = (
            f"in the {case.name!r} data run the connector reported {stats.failed_load_blocks} block(s) failed to "
            "load though nothing failed"
        )
        refused = store_refusals(result.records)
        if refused is not None:  # the store layer knows why: the store's calls, not the hooks
            raise ConformanceFailure(f"{seen}: {refused.observed}", refused.fix)
        raise ConformanceFailure(f"{seen}: it claimed more tokens than it holds")
    if stats.prompt_tokens_loaded == 0 and session.every_data_run_loads:
        seen = (
            f"in the {case.name!r} data run, requests sharing full blocks with earlier ones, whose local copies "
            "were gone, loaded no token through the connector"
        )
        why = store_trouble(result.records, stats.degraded_events, result.warnings) or lost_saves(result.records)
        raise ConformanceFailure(seen) if why is None else ConformanceFailure(f"{seen}; {why.observed}", why.fix)
    compare_tokens(session, case, result, when, fix)
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
        raise ConformanceFailure(
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
    lose track of the request afterwards. The run is played again with its
    last request on a second engine instance (new scheduler and worker, the
    same config, so the same store where it outlives an instance): a
    connector that poisoned the store and stops claiming the failed block
    itself still fails there.

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
        raise ConformanceFailure(
            f"in the {FAILED_LOAD.name!r} run the connector loaded nothing, so no load could be made to fail"
        )
    compare_tokens(session, FAILED_LOAD, result, " (its first load failed)")
    tracked = {role: n for role, n in result.driver.num_tracked_requests().items() if n}
    if tracked:
        raise ConformanceFailure(
            f"after a failed load and every request ending, get_num_tracked_requests says {tracked}"
        )
    # What it saved after the failure, judged by an engine that never saw it (a connector that stops claiming
    # a block whose load failed hides a poisoned store from its own instance, not from the others sharing it).
    elsewhere = data_run(session, FAILED_LOAD_ELSEWHERE, fail_loads="first")
    compare_tokens(
        session,
        FAILED_LOAD_ELSEWHERE,
        elsewhere,
        " (its first load failed; 'b1' then ran on another engine instance sharing its store)",
    )


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
    claimed = result.loaded("b")
    there = "its worker side in another process (as vLLM's multiprocess engine runs it)"
    if (
        result.tokens != expected_tokens(session, LOST_BLOCKS, result.driver.shape)
        and not result.driver.stats.failed_load_blocks
    ):
        raise ConformanceFailure(
            f"in the {LOST_BLOCKS.name!r} data run with {there}, the connector claimed {claimed} tokens for 'b', the "
            "worker side did not have them, it reported no block failed to load, and 'b' ran on wrong KV"
        )
    compare_tokens(session, LOST_BLOCKS, result, f" (with {there})")
    failed = result.driver.stats.failed_load_blocks
    if claimed and failed * result.driver.block_size >= claimed and not _in_process_state(result.driver):
        raise ConformanceFailure(
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
    if (
        result.tokens != expected_tokens(session, LOST_BLOCKS, result.driver.shape)
        and not result.driver.stats.failed_load_blocks
    ):
        claimed = result.loaded("b")
        raise ConformanceFailure(
            f"in the {LOST_BLOCKS.name!r} data run the connector claimed {claimed} tokens for 'b', its worker's "
            "store (a fresh namespace) had none of them, it reported no block failed to load, and 'b' ran on wrong KV"
        )
    compare_tokens(session, LOST_BLOCKS, result, " (its worker's store was emptied)")


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


#: KV043's fix when a request preempted mid-prefill went wrong: what changes at its resume.
RESUMED_PREFILL_FIX = (
    "a request preempted mid-prefill resumes with a new table and computes its prompt again, in chunks, from "
    "num_computed_tokens (0, or the tokens loaded for it): read its table (get_block_ids) and num_computed_tokens "
    "afresh each step, never a table, an offset or a count of tokens kept from before the preemption"
)


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

    Then a prompt is preempted mid-prefill, once the connector saw (and may
    have saved) its first chunks, resumes, and a later request loads its
    prefix (:func:`preempted_mid_prefill`).
    """
    result = data_run(session, PREEMPTED_SAVES)
    if not any(record.preempted for record in result.records):
        raise nothing_preempted(f"the {PREEMPTED_SAVES.name!r} data run")
    _exact(session, PREEMPTED_SAVES)
    preempted_mid_prefill(session)


def preempted_mid_prefill(session: Session) -> None:
    """KV043's second part: a prompt preempted mid-prefill and resumed is saved right; its prefix loads exact.

    ``a1``'s prompt is preempted with two of its blocks computed, resumes
    with a new table and computes the rest again in chunks that end
    mid-block; ``b`` loads its prefix. Catches what a decode preempted and
    resumed in one step cannot show: a count of the request's tokens, or an
    offset, kept across the preemption (LMCache's request tracker), by which
    blocks the resumed request has not computed again look full and are
    saved; and the stale tables :data:`PREEMPTED_SAVES` catches. Judged on
    the tokens even when the connector's timing admitted the requests apart
    and nothing was preempted (then the failure does not claim it).
    """
    result = data_run(session, PREEMPTED_PREFILL)
    computed = computed_when_preempted(result.records, result.tag.engine_id(PREFILL_PREEMPTED))
    if computed is None or not 0 < computed < PREFILL_PROMPT_LEN:
        _exact(session, PREEMPTED_PREFILL)
        return
    when = (
        f" ({PREFILL_PREEMPTED!r} was preempted mid-prefill with {computed} of its {PREFILL_PROMPT_LEN} prompt "
        "tokens computed, then resumed)"
    )
    _exact(session, PREEMPTED_PREFILL, when, RESUMED_PREFILL_FIX)


def computed_when_preempted(records: Sequence[StepRecord], req_id: str) -> int | None:
    """The tokens ``req_id`` (the engine's id) had computed when it was first preempted (``None``: it never was)."""
    computed = 0
    for record in records:
        if req_id in record.preempted:
            return computed
        scheduled = record.output.num_scheduled_tokens.get(req_id)
        if scheduled:
            computed = record.output.num_computed_tokens_by_request()[req_id] + scheduled
    return None


#: KV049's fix: what a resumed request's second load needs.
RELOAD_FIX = (
    "a request preempted and resumed is asked again (get_num_new_matched_tokens, from 0 computed tokens) and loads "
    "again, into its new table: carry out every load the metadata names, and keep no per-request mark ('loaded', "
    "'done') past the load it was for (forget it once the load is reported): the same request id loads twice"
)


def reloaded_after_preemption(result: DataResult) -> tuple[str, int] | None:
    """The first request of :data:`~..runs.RELOADING` preempted after a load, and the tokens it had loaded then."""
    for name in RELOADING:
        engine_id, loaded = result.tag.engine_id(name), 0
        for record in result.records:
            if engine_id in record.preempted and loaded:
                return name, loaded
            loaded += record.loaded.get(engine_id, 0)
    return None


@check(
    "KV049",
    "preempted-loads",
    fix=RELOAD_FIX,
    **{**PREEMPTED_DATA_CHECK, "after": (*PREEMPTED_DATA_CHECK["after"], "KV043")},
)
def preempted_loads(session: Session) -> None:
    """A request preempted after loading its prefix loads it again at its resume, into its new table; tokens exact.

    Two requests load three blocks each and grow in a small pool until one is
    preempted; it resumes with a new table once the other ends, and the engine
    asks the connector again. Catches a worker that marks a request as loaded
    (to skip a load its metadata repeats, or to report it once) and never
    forgets the mark: the second load is skipped or reported done unread, and
    the resumed request reads whatever its new blocks held.
    """
    result = data_run(session, PREEMPTED_LOADS)
    if not any(record.preempted for record in result.records):
        raise nothing_preempted(f"the {PREEMPTED_LOADS.name!r} data run")
    reloaded = reloaded_after_preemption(result)
    if reloaded is None:  # preempted before it loaded anything: judged on its tokens alone
        _exact(session, PREEMPTED_LOADS)
        return
    name, loaded = reloaded
    when = f" ({name!r} loaded {loaded} tokens, was preempted, and resumed with a new table to load again)"
    _exact(session, PREEMPTED_LOADS, when, RELOAD_FIX)


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
    fix="give every run a store of its own: a namespace (or directory) from the config, and a fresh one per run "
    "from the connector's fresh_store_config(run, directory) classmethod (a StoreConnector has one), or a config "
    "factory: kvconn validate --config-factory pkg.mod:function, or in pytest override "
    "ConnectorConformance.config_factory(run, directory)",
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
            raise ConformanceFailure(
                f"in the {case.name!r} data run, {dict(sorted(leaked.items()))} tokens were loaded on its first step, "
                "before anything was computed in it: the store kept blocks from an earlier run"
            )


@check(
    "KV047",
    "isolation",
    fix="key blocks by the engine's block hashes (request.block_hashes): they carry vLLM's extra keys, the "
    "request's LoRA adapter (its KV differs) and its cache_salt (a tenant's prefixes are its own); a key built "
    "from the token ids alone mixes adapters and serves one tenant's cached KV to another",
    **UNTIDY_DATA_CHECK,
)
def isolation(session: Session) -> None:
    """Blocks computed under one ``cache_salt`` or adapter never load for another, whose tokens stay exact.

    Tenant ``tenant-1`` and adapter ``adapter-1`` compute prefixes; then
    ``tenant-2`` and ``adapter-2`` run the same tokens (nothing to load: their
    block hashes differ), then the first tenant and adapter again (a hit).
    Catches connectors that key blocks by their tokens rather than the
    engine's hashes: another adapter's KV gives wrong tokens, and another
    tenant's prefix is a leak even when the tokens are right (``cache_salt``
    exists to stop one tenant timing, or reading, another's cached prompts).
    """
    result = data_run(session, ISOLATION)
    for req_id, source in ISOLATED.items():
        loaded = result.loaded(req_id)
        if loaded:
            keys = next(r.keys for phase in ISOLATION.phases for r in phase if r.req_id == req_id)
            other = ("adapter", keys.adapter) if keys.adapter else ("cache_salt", keys.cache_salt)
            raise ConformanceFailure(
                f"in the {ISOLATION.name!r} data run, request {req_id!r} ({other[0]} {other[1]!r}) loaded {loaded} "
                f"tokens of the prefix {source!r} computed under another {other[0]}: a block hash carries the "
                f"{other[0]}, so nothing was there to load for {req_id!r}"
                + (" (a cross-tenant hit, whatever its tokens)" if other[0] == "cache_salt" else "")
            )
    _exact(session, ISOLATION)


@check(
    "KV048",
    "tensor-parallel",
    fix=RANK_KEY_FIX,
    **UNTIDY_DATA_CHECK,
)
def tensor_parallel(session: Session) -> None:
    """Two tensor-parallel ranks share one store per run, each saving and loading its own shard; tokens exact.

    The engine runs rank 0 and rank 1, each with half of the heads and a
    worker side of its own whose context names its rank; their reads add up
    before sampling, so the tokens are the single-rank engine's. Catches
    store keys that leave out the rank: the two shards of a block land under
    one key, and a rank loads the other's.
    """
    try:
        _exact(session, TENSOR_PARALLEL)
    except ScenarioUnsupported as exc:
        raise CheckSkipped(str(exc)) from None
