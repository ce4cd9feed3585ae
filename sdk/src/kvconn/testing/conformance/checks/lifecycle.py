"""KV030-KV032: request lifecycle: finishing, reporting, forgetting."""

from __future__ import annotations

from collections import Counter

from ..catalog import IMPORTED, SCHEDULER_CHECK, check
from ..results import CheckSkipped, Violation
from ..session import Session
from .data import all_runs


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
            raise Violation(f"in {trace.where()}: request_finished calls per request {wrong} (expected 1 each)")
        if trace.stuck:
            raise Violation(
                f"in {trace.where()}: after every request ended, blocks were still held for the connector "
                "(request_finished delayed the free, finished_sending never released it)"
            )


@check(
    "KV031",
    "get-finished-once",
    fix="report a request in finished_sending only if request_finished returned True for it, in "
    "finished_recving only for an async load, and each once: remove it from your pending set when you report it",
    requires=("worker",),
    after=IMPORTED,
)
def get_finished_once(session: Session) -> None:
    """``get_finished`` reports each request at most once, and only what the engine is waiting for.

    Reads every run: the scenarios (one has requests finishing, and one
    aborted, on the step that fills a block) and the data runs. Catches
    workers that report a transfer as finished on every call until the
    request is gone (the engine frees blocks twice, or resumes a request
    whose load it already resumed), that report a sync load in
    ``finished_recving`` or a request whose free was not delayed in
    ``finished_sending``, and that report ids they made up.
    """
    for where, records, _ in all_runs(session):
        counts: dict[str, Counter[str]] = {kind: Counter() for kind in ("finished_sending", "finished_recving")}
        for record in records:
            if record.unexpected_reports:
                raise Violation(f"in {where}, step {record.step}: {record.unexpected_reports[0]}")
            out = record.connector_output
            for kind, counter in counts.items():
                counter.update(getattr(out, kind) if out is not None else ())
        for kind, counter in counts.items():
            twice = sorted(r for r, n in counter.items() if n > 1)
            if twice:
                raise Violation(f"in {where}: {kind} reported {twice} more than once")


@check(
    "KV032",
    "no-leaks",
    fix="forget a request in request_finished (scheduler side) and when its transfers are reported finished "
    "(worker side); get_num_tracked_requests must count what you still hold",
    **SCHEDULER_CHECK,
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
            raise Violation(f"in {trace.where()}: after every request ended, get_num_tracked_requests says {leaked}")
        reported = reported or bool(trace.tracked)
        if trace.leak:
            raise Violation(f"in {trace.where()}: after every request ended: {trace.leak}")
    if not reported:
        raise CheckSkipped("the connector does not implement get_num_tracked_requests; the engine itself is empty")
