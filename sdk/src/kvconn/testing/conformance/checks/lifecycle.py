"""Request lifecycle: finishing, reporting, forgetting."""

from __future__ import annotations

from collections import Counter

from ..catalog import IMPORTED, SCHEDULER_CHECK, check
from ..results import CheckSkipped, ConformanceFailure
from ..runs import all_runs
from ..session import Session


@check(
    "KV030",
    "request-finished",
    fix="return True from request_finished only while a save still reads the request's blocks, and then "
    "report the request in get_finished's finished_sending once that save completes",
    **SCHEDULER_CHECK,
)
def request_finished(session: Session) -> None:
    """``request_finished`` runs once per request, and a delayed free is always released.

    Catches connectors that return ``True`` (delay freeing the blocks) and
    never report the request in ``finished_sending``: its blocks stay held
    forever, and the cache shrinks with every request until the engine
    stalls. Also checks that every request the scenarios add (finished,
    aborted while waiting or running, preempted and resumed) reaches the
    connector's ``request_finished`` exactly once.
    """
    for trace in session.completed_traces():
        wrong = {r: trace.finished_calls.get(r, 0) for r in trace.request_ids if trace.finished_calls.get(r, 0) != 1}
        if wrong:
            raise ConformanceFailure(
                f"in {trace.where()}: request_finished calls per request {wrong} (expected 1 each)"
            )
        if trace.stuck:
            held = "blocks were still held for the connector (request_finished delayed the free, finished_sending "
            stalled = trace.stalled
            if stalled is None or stalled.fix is None:
                raise ConformanceFailure(f"in {trace.where()}: after every request ended, {held}never released it)")
            raise ConformanceFailure(f"in {trace.where()}: {stalled}", stalled.fix)


@check(
    "KV031",
    "get-finished-once",
    fix="report a request in finished_sending only if request_finished returned True for it, in "
    "finished_recving only for an async load, and each once: remove it from your pending set when you report it",
    requires=("worker",),
    after=IMPORTED,
)
def get_finished_once(session: Session) -> None:
    """``get_finished`` reports each transfer once, and only what the engine is waiting for.

    Reads every run: the scenarios (one has requests finishing, and one
    aborted, on the step that fills a block) and the data runs. Catches
    workers that report a transfer as finished on every call until the
    request is gone (the engine frees blocks twice, or resumes a request
    whose load it already resumed), that report a sync load in
    ``finished_recving`` or a request whose free was not delayed in
    ``finished_sending``, and that report ids they made up.

    What vLLM waits for (``Scheduler._update_from_kv_xfer_finished``): one
    ``finished_sending`` per request whose free ``request_finished`` delayed
    (it runs once per request), and one ``finished_recving`` per async load,
    each of which puts the request in ``WAITING_FOR_REMOTE_KVS``. A request
    preempted and resumed while its prefix is in the store loads again: it
    is reported once per load, which is right.
    """
    for where, records, _ in all_runs(session):
        counts: dict[str, Counter[str]] = {kind: Counter() for kind in ("finished_sending", "finished_recving")}
        loads, resumes = Counter[str](), Counter[str]()
        for record in records:
            if record.unexpected_reports:
                raise ConformanceFailure(f"in {where}, step {record.step}: {record.unexpected_reports[0]}")
            loads.update(r for r, n in record.loaded.items() if n)
            resumes.update(record.preempted)
            out = record.connector_output
            for kind, counter in counts.items():
                counter.update(getattr(out, kind) if out is not None else ())
        tracks_loads = any(record.loaded for record in records)
        # a driver recording no loads: a request can load again each time it resumes after preemption
        allowed = {r: loads[r] if tracks_loads else 1 + resumes[r] for r in counts["finished_recving"]}
        allowed |= {r: 1 for r in counts["finished_sending"]}
        for kind, counter in counts.items():
            over = {r: (n, allowed[r]) for r, n in sorted(counter.items()) if n > allowed[r]}
            if over:
                per = "async load" if kind == "finished_recving" else "delayed free"
                detail = ", ".join(
                    f"{r!r} {n} times for {m} {per}{'s' if m != 1 else ''}" for r, (n, m) in over.items()
                )
                raise ConformanceFailure(f"in {where}: {kind} reported {detail}: more than once per {per}")


@check(
    "KV032",
    "no-leaks",
    fix="forget a request in request_finished (scheduler side) and when its transfers are reported finished "
    "(worker side); get_num_tracked_requests must count what you still hold",
    # blocks held for a report that never came are KV030's finding, with its fix: one root cause, not two
    **{**SCHEDULER_CHECK, "after": (*SCHEDULER_CHECK["after"], "KV030")},
)
def no_leaks(session: Session) -> None:
    """Once every request has ended, the connector tracks none and the engine holds nothing.

    Catches per-request state that is never dropped (a dict entry added in
    ``update_state_after_alloc`` and removed only on some paths, e.g. not on
    abort or preemption): memory that grows with every request served.
    Reads ``get_num_tracked_requests`` on both sides, then checks the engine
    is empty (no request, held block, reference or load in flight).
    """
    reported = False
    for trace in session.completed_traces():
        leaked = {role: n for role, n in trace.tracked.items() if n}
        if leaked:
            raise ConformanceFailure(
                f"in {trace.where()}: after every request ended, get_num_tracked_requests says {leaked}"
            )
        reported = reported or bool(trace.tracked)
        if trace.leak:
            raise ConformanceFailure(f"in {trace.where()}: after every request ended: {trace.leak}")
    if not reported:
        raise CheckSkipped("the connector does not implement get_num_tracked_requests; the engine itself is empty")
