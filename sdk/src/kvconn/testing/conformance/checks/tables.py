"""The scheduler side: scenarios, block tables, offered requests, laziness, read-only tables."""

from __future__ import annotations

from dataclasses import replace

from ....context import NULL_BLOCK_ID
from ....hashing import hash_blocks
from ..catalog import SCHEDULER_CHECK, check, get_check
from ..diagnose import shifted_pairing, transfer_kind
from ..driver import ScenarioUnsupported
from ..metadata_blocks import hashed_blocks
from ..results import CheckSkipped, ConformanceFailure, nothing_preempted
from ..runs import BLOCK_FILL_CONTROL, BLOCK_FILL_REUSE, BLOCK_FILL_SETTLED, DataResult, Run, all_runs, data_run
from ..scenarios import BLOCK_FILL_CHUNK, OFFERED_ONLY, Trace
from ..session import Session
from ..trace_steps import StepView, completing_a_block, live_ids, step_views
from ..waits import wait_seconds


def _views(session: Session, trace: Trace) -> list[StepView]:
    return session.memo(f"views:{trace.scenario.name}", lambda: step_views(trace))


@check(
    "KV010",
    "scenarios",
    fix="make every hook cope with the situation named in the error (see docs/checks.md for each scenario)",
    **SCHEDULER_CHECK,
)
def scenarios(session: Session) -> None:
    """Every scripted scenario runs to completion without the connector raising.

    Catches connectors that assume one shape of traffic: chunked prefill,
    decode across block boundaries, preemption and resume, aborts of waiting
    and running requests, two KV-cache groups (full + sliding window, with
    null blocks), 256-token blocks, and many requests sharing a prefix.
    """
    session.completed_traces()


@check(
    "KV011",
    "block-fill",
    fix="each step, read the table of every request you act on with block_state.get_block_ids(req_id), "
    "including requests that got no new block this step (the step that fills a block allocates none)",
    **SCHEDULER_CHECK,
)
def block_fill(session: Session) -> None:
    """On the step that fills a block (and allocates none), the connector sees the request's live table.

    Catches the bug this SDK exists for: a connector that only looks at
    requests that got new blocks this step (``scheduled_new_reqs`` and
    ``new_block_ids``) misses the request on exactly the step a full-block
    saver must save it, and crashes, skips the save, or saves a stale table.
    Observed in the metadata: a request the connector refers to when its
    table grows must be referred to on its block-fill steps too, and any
    block id it carries for the request must be in the live table. Besides
    the standard scenarios, one of its own: a prefill chunk that ends on a
    block boundary (vLLM 0.29's ``MooncakeStoreConnector`` asserts there).

    Judged by what lands too, whatever the metadata looks like: for a
    connector that saves and loads, a request sharing the three full blocks
    of a prompt whose third block filled on such a step must be able to load
    as many of them as when the prompt computed in one step that allocated
    all three (:data:`~..runs.BLOCK_FILL_REUSE` against
    :data:`~..runs.BLOCK_FILL_CONTROL`: a connector that reuses only some
    blocks by design claims alike in both). A connector may save in the
    background and count only what has landed, so a shortfall is judged again
    with ``b`` arriving half the wait bound after ``a`` finished.
    """
    judged = _block_fill_lands(session)
    traces = session.completed_traces()
    fill = session.trace(BLOCK_FILL_CHUNK)
    if fill.error:
        raise ConformanceFailure(
            f"on the block-fill step of a chunked prefill ({BLOCK_FILL_CHUNK.description}): {fill.error}"
        )
    for trace in [*traces, fill]:
        views = _views(session, trace)
        tracked = {r for v in views for r in v.grow if v.refs.get(r)}
        for view in views:
            record = trace.records[view.index]
            for req_id in sorted(view.fill):
                refs = view.refs.get(req_id)
                if refs is None and req_id in tracked:
                    early = _saved_early(trace, view.index, req_id)
                    if early:
                        block, step = early
                        raise ConformanceFailure(
                            f"in {trace.where()}, step {record.step}: {req_id}'s block {block} filled, and the "
                            f"metadata had paired it with its hash to save at step {step} already, before its "
                            "tokens were all computed",
                            EARLY_BLOCK_FIX,
                        )
                    raise ConformanceFailure(
                        f"in {trace.where()}, step {record.step}: {req_id} filled a block without allocating one, "
                        "and the metadata carries nothing for it, while it does on the steps its table grows"
                    )
                stale = {b for ids in refs or () for b in ids} - live_ids(record.tables.get(req_id)) - {0}
                if stale:
                    raise ConformanceFailure(
                        f"in {trace.where()}, step {record.step} (the block-fill step of {req_id}): the metadata "
                        f"carries blocks {sorted(stale)} for it, not in its live table {record.tables.get(req_id)}"
                    )
    if not judged and not any(v.refs for t in session.standard_traces() for v in _views(session, t)):
        raise CheckSkipped(
            "the connector neither saves and loads (so what lands cannot be judged) nor carries a request's block "
            "ids in its metadata (so its tables cannot): a connector that moves KV is judged by a later request "
            "loading what it saved"
        )


#: KV011's fix when the block a step fills had been acted on before that step: a count that ran ahead.
EARLY_BLOCK_FIX = (
    "act on a block only once the request's num_computed_tokens (at the step's start) plus its scheduled tokens "
    "cover it, counted afresh each step: a count of tokens kept from before a preemption runs ahead of a request "
    "that computes its prompt again"
)


def _saved_early(trace: Trace, upto: int, req_id: str) -> tuple[int, int] | None:
    """The block ``req_id`` fills on record ``upto``, and the earlier step whose metadata saved it, if one did.

    A (block, hash) pair outside a load is a save of that block (a block's
    hash is known from the prompt before the block is computed). Counted from
    the request's last scheduling with a new table (new, or resumed after
    preemption).
    """
    saved: dict[int, int] = {}
    for record in trace.records[:upto]:
        cached = record.output.scheduled_cached_reqs
        if req_id in {new.req_id for new in record.output.scheduled_new_reqs} or any(
            r == req_id and resumed for r, resumed in zip(cached.req_ids, cached.resumed_from_preemption, strict=True)
        ):
            saved.clear()
        for pair in hashed_blocks(record.metadata, [req_id]) if record.metadata is not None else ():
            if transfer_kind(pair.path) != "load":
                saved.setdefault(pair.block_id, record.step)
    output = trace.records[upto].output
    position = (
        output.num_computed_tokens_by_request()[req_id] + output.num_scheduled_tokens[req_id]
    ) // trace.block_size
    for group in trace.records[upto].tables.get(req_id) or ():
        block = group[position - 1] if 0 < position <= len(group) else NULL_BLOCK_ID
        if block != NULL_BLOCK_ID and block in saved:
            return block, saved[block]
    return None


def _block_fill_lands(session: Session) -> bool:
    """What a saving and loading connector saved on a block-fill step can be loaded; whether that applied."""
    if not {"saves", "loads"} <= session.capabilities:
        return False
    if session.run(get_check("KV044")).status == "failed":
        return False  # a save deferred past its step (KV044's root cause) is claimable a step late: not this bug
    try:
        claimed, control = (_claimed(data_run(session, case)) for case in (BLOCK_FILL_REUSE, BLOCK_FILL_CONTROL))
    except ScenarioUnsupported:
        return False
    if claimed < control:  # perhaps a background save not landed yet when 'b' looked: once more, 'b' later
        claimed = _claimed(data_run(session, replace(BLOCK_FILL_SETTLED, settle_s=wait_seconds() / 2)))
    if claimed < control:
        raise ConformanceFailure(
            f"in the {BLOCK_FILL_REUSE.name!r} data run, 'a' ({BLOCK_FILL_CHUNK.description}) finished with 3 full "
            f"blocks, and 'b', sharing all three, loaded {claimed} tokens of them, where it loads {control} when "
            f"'a''s prompt computes in one step ({BLOCK_FILL_CONTROL.name!r}): the block filled on the step that "
            "allocated none was never saved (a connector acting only on requests that got new blocks misses that step; "
            f"'b' loaded as little when it came {wait_seconds() / 2:g} s after 'a' ended, time for any background save)"
        )
    return True  # what the loaded bytes hold is the data checks' (KV040 reads a block filled by a decode step)


def _claimed(result: DataResult) -> int:
    """The tokens ``b`` loaded through the connector in a block-fill run."""
    return result.loaded("b")


@check(
    "KV012",
    "stale-tables",
    fix="never keep a table across steps (preemption replaces it): read it each step with "
    "block_state.get_block_ids(req_id); do not rebuild it by appending new_block_ids",
    **SCHEDULER_CHECK,
)
def stale_tables(session: Session) -> None:
    """After preemption and resume, nothing the connector sends refers to the request's old table.

    Catches connectors that cache a request's table (or rebuild it by
    appending ``new_block_ids``) and keep using it after preemption replaced
    it, or after sliding-window blocks were freed: saves then read, and
    loads overwrite, blocks that now belong to another request.
    """
    traces = session.completed_traces()
    preempted = [r for t in traces for rec in t.records for r in rec.preempted]
    if not preempted:
        raise nothing_preempted("the preemption scenario")
    for trace in traces:
        before: dict[str, set[int]] = {}
        for view in _views(session, trace):
            record = trace.records[view.index]
            for req_id, refs in view.refs.items():
                if req_id is None or req_id in view.fill:
                    continue  # block-fill steps are KV011's
                live = live_ids(record.tables.get(req_id))
                stale = {b for ids in refs for b in ids} - live - {0}
                if stale:
                    old = stale & before.get(req_id, set())
                    why = f"from its table before preemption {sorted(before[req_id])}" if old else "not in it"
                    raise ConformanceFailure(
                        f"in {trace.where()}, step {record.step}: the metadata carries blocks {sorted(stale)} for "
                        f"{req_id}, whose live table is {record.tables.get(req_id)} ({why})"
                    )
            for req_id, table in record.tables.items():
                if req_id not in record.preempted:
                    before[req_id] = live_ids(table)
    for run in all_runs(session):
        _check_positions(run)


def _check_positions(run: Run) -> None:
    """A block id the metadata pairs with the hash of a request's block ``i`` is at position ``i`` of its table."""
    tokens: dict[str, list[int]] = {}
    hashes: dict[str, list[bytes]] = {}
    preempted: set[str] = set()
    for record in run.records:
        preempted |= record.preempted
        out = record.output
        for new in out.scheduled_new_reqs:
            tokens[new.req_id] = list(new.prompt_token_ids)
        cached = out.scheduled_cached_reqs
        for req_id, added in zip(cached.req_ids, cached.new_token_ids, strict=True):
            tokens.setdefault(req_id, []).extend(added)
        for req_id, all_ids in cached.all_token_ids.items():
            tokens[req_id] = list(all_ids)
        if record.metadata is None:
            continue
        for req_id, block_id, block_hash, path in hashed_blocks(record.metadata, tokens):
            known = hashes.get(req_id, [])
            if len(known) != len(tokens[req_id]) // run.block_size:
                known = hashes[req_id] = hash_blocks(tokens[req_id], run.block_size)
            table = record.tables.get(req_id)
            if table is None or block_hash not in known:
                continue
            index = known.index(block_hash)
            here = [group[index] for group in table if index < len(group)]
            if block_id not in here:
                where = f"in {run.where}, step {record.step}"
                # a table never replaced (no preemption), or a load's (handed by update_state_after_alloc
                # this step) is not stale: an index is shifted
                if req_id not in preempted or transfer_kind(path) == "load":
                    shifted = shifted_pairing(where, path, req_id, block_id, index, table)
                    if shifted is not None:
                        raise ConformanceFailure(shifted.observed, shifted.fix)
                raise ConformanceFailure(
                    f"in {run.where}, step {record.step}: the metadata pairs block {block_id} with the hash of "
                    f"block {index} of {req_id}, but position {index} of its live table {table} holds {here}"
                )


@check(
    "KV013",
    "offered-only",
    fix="block_state.get_block_ids(req_id) returns None for a request not offered this step: skip it "
    "(or retry next step); never call block_state.resolve_block_ids yourself",
    **SCHEDULER_CHECK,
)
def offered_only(session: Session) -> None:
    """The connector copes with ``None`` for a request outside the offered set.

    Catches connectors that assume every scheduled request's table is there
    (``assert table is not None``, ``block_state.block_ids[req_id]``) and
    crash when an engine offers fewer, and connectors that bypass
    ``get_block_ids`` to resolve requests that were not offered.
    """
    session.completed_traces()  # a connector broken everywhere is reported once, by the check that meets it first
    trace = session.trace(OFFERED_ONLY)
    if trace.error:
        withheld = ", ".join(sorted(OFFERED_ONLY.withhold))
        raise ConformanceFailure(f"with {withheld} scheduled but not offered, the connector raised: {trace.error}")
    for record in trace.records:
        bypass = sorted(set(record.resolved) - record.offered)
        if bypass:
            raise ConformanceFailure(f"step {record.step}: tables of {bypass} were resolved though not offered")


@check(
    "KV014",
    "lazy-resolve",
    fix="call block_state.get_block_ids only for the requests you act on this step, not for every offered "
    "one (and never iterate the deprecated block_state.block_ids)",
    **SCHEDULER_CHECK,
)
def lazy_resolve(session: Session) -> None:
    """The connector resolves at most the tables of the requests it acts on.

    Catches eager connectors that resolve every offered table each step (the
    cost the lazy block state removes) and connectors that call the
    resolver for requests outside the offered set. A request counts as acted
    on when the step's metadata carries some of its block ids, or when the
    step completes one of its blocks (what a full-block saver resolves a
    table for), so a connector whose metadata names no request (block hash
    and block id pairs) is judged by the steps it resolves on, not by its
    metadata's shape.
    """
    for trace in session.completed_traces():
        for view in _views(session, trace):
            record = trace.records[view.index]
            bypass = sorted(set(record.resolved) - record.offered)
            if bypass:
                raise ConformanceFailure(
                    f"in {trace.where()}, step {record.step}: tables of {bypass} were resolved though not offered"
                )
            loose = {b for ids in view.refs.get(None, ()) for b in ids}
            acted = (
                {r for r in view.refs if r is not None}
                | {r for r in record.resolved if live_ids(record.tables.get(r)) & loose}
                | completing_a_block(record.output, trace.block_size)
            )
            unused = sorted(set(record.resolved) - acted)
            if unused:
                raise ConformanceFailure(
                    f"in {trace.where()}, step {record.step}: resolved the tables of {unused} "
                    f"({len(set(record.resolved))} of {len(record.offered)} offered) but its metadata uses none of them"
                )


@check(
    "KV015",
    "read-only-tables",
    fix="treat every table you are handed as read-only (the same lists go to the other connectors of the host "
    "and to the engine): copy it before changing it, e.g. [b for b in group if b != NULL_BLOCK_ID]",
    **SCHEDULER_CHECK,
)
def read_only_tables(session: Session) -> None:
    """No hook changes a block table it was handed.

    Every table a hook receives (``update_state_after_alloc``'s and
    ``request_finished``'s ``block_ids``, ``get_block_ids``' result, the
    scheduler output's ``block_ids`` and ``new_block_ids``) is compared with a
    snapshot at the end of that step and every later one, in every scenario
    and data run. Catches connectors that strip null blocks, sort or append in
    place, or keep a table and extend it steps later: the tables are shared
    with the other connectors of a host and with the engine itself.
    """
    for where, records, _ in all_runs(session):
        for record in records:
            if record.mutated:
                raise ConformanceFailure(f"in {where}, step {record.step}, the connector changed {record.mutated[0]}")
