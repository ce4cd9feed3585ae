"""KV030-KV032: request lifecycle: finishing, reporting, forgetting."""

from __future__ import annotations

from collections import Counter

from ..catalog import check
from ..results import CheckSkipped, Violation
from ..session import Session


@check(
    "KV030",
    "request-finished",
    fix="return True from request_finished only while a save still reads the request's blocks, and then "
    "report the request in get_finished's finished_sending once that save completes",
    requires=("scheduler",),
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
    fix="report each request at most once in finished_sending and once in finished_recving: remove it from "
    "your pending set when you report it",
    requires=("worker",),
)
def get_finished_once(session: Session) -> None:
    """``get_finished`` reports each request at most once, and only requests the engine knows.

    Catches workers that report a transfer as finished on every call until
    the request is gone (the engine frees blocks twice, or resumes a request
    whose load it already resumed), and workers that report ids they made up.
    """
    for trace in session.completed_traces():
        known = set(trace.request_ids)
        for kind in ("finished_sending", "finished_recving"):
            counts: Counter[str] = Counter()
            for record in trace.records:
                out = record.connector_output
                counts.update(getattr(out, kind) if out is not None else ())
            twice = sorted(r for r, n in counts.items() if n > 1)
            if twice:
                raise Violation(f"in {trace.where()}: {kind} reported {twice} more than once")
            unknown = sorted(set(counts) - known)
            if unknown:
                raise Violation(f"in {trace.where()}: {kind} reported unknown requests {unknown}")


@check(
    "KV032",
    "no-leaks",
    fix="forget a request in request_finished (scheduler side) and when its transfers are reported finished "
    "(worker side); get_num_tracked_requests must count what you still hold",
    requires=("scheduler",),
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
