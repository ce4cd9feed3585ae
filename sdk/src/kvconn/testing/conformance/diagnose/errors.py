"""A run that raised or stopped making progress: which frame of the connector raised and in what situation,
which request waits for which report and since which answer."""

from __future__ import annotations

import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvconn.errors import HookOverBudget

from .diagnosis import Diagnosis

__all__ = [
    "HOOK_BUDGET_FIX",
    "Awaited",
    "Stalled",
    "WaitsReporter",
    "connector_frame",
    "diagnose_error",
    "engine_failure",
    "stall",
]


@dataclass(frozen=True)
class Awaited:
    """A report the engine waits for: ``kind`` (``finished_sending`` / ``finished_recving``) of ``req_id``,
    since ``step``, when the connector's ``answer`` started the wait."""

    req_id: str
    kind: str
    step: int
    answer: str
    #: the request ended (aborted) while the engine waited: only its blocks are still held
    ended: bool = False


class WaitsReporter(Protocol):
    """What a driver can say beyond the protocol, for a diagnosis (optional; the reference driver can).

    ``awaited``: the reports its engine still waits for. ``situation``: what
    the step in progress has that a connector may not cope with (null blocks
    in a table, a request resumed after preemption, ...), one phrase each.
    """

    def awaited(self) -> list[Awaited]: ...

    def situation(self) -> list[str]: ...


#: The fix for a wait that never ends, per report kind.
_FIXES = {
    "finished_sending": "report {ids} in get_finished's finished_sending (once) as soon as the save that made "
    "request_finished return True no longer reads its blocks; return False from request_finished when no save "
    "of the request is pending",
    "finished_recving": "report {ids} in get_finished's finished_recving (once) when the async load started for "
    "it (get_num_new_matched_tokens returned load_async=True) has landed, also when the request ended meanwhile "
    "(finished_req_ids): the engine holds an aborted request's blocks until its load is reported; a load that "
    "cannot complete is reported too, with its blocks in get_block_ids_with_load_errors",
}
_WAITS_FOR = {
    "finished_sending": "its blocks stay held until finished_sending reports it",
    "finished_recving": "it cannot be scheduled until finished_recving reports it",
}
#: What an aborted request still waits for, per report kind: its blocks, which the worker may still be writing.
_ENDED_WAITS_FOR = {
    "finished_sending": _WAITS_FOR["finished_sending"],
    "finished_recving": "then it was aborted, and its blocks stay held until finished_recving reports the load (the "
    "worker may still be writing into them)",
}


class Stalled(RuntimeError):
    """A run stopped making progress; ``fix`` is the fix for what it waits for (``None``: not known)."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.fix = fix


def stall(driver: object, what: str) -> Stalled:
    """The error for a run that stopped making progress: ``what`` happened, and the requests still awaited.

    Names each request, the report it waits for and the answer that started
    the wait, when the driver can say (:class:`WaitsReporter`).
    """
    awaited: list[Awaited] = _ask(driver, "awaited")
    if not awaited:
        return Stalled(
            f"{what}: the KV cache is full of blocks held for the connector (a delayed free never reported in "
            "finished_sending?), or a load never finishes"
        )
    first = awaited[0]
    same = [a.req_id for a in awaited[1:] if a.kind == first.kind]
    others = f" (and {len(same)} more the same way: {', '.join(map(repr, same))})" if same else ""
    waits = (
        f"request {first.req_id!r} waits for {first.kind} since step {first.step}, when {first.answer}: "
        f"{(_ENDED_WAITS_FOR if first.ended else _WAITS_FOR)[first.kind]}, and get_finished never reported "
        f"it{others}"
    )
    ids = ", ".join(repr(r) for r in [first.req_id, *same])
    return Stalled(f"{what}: {waits}", _FIXES[first.kind].format(ids=ids))


_SDK = Path(__file__).resolve().parents[3]  # the kvconn package
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()


def _connector_code(filename: str) -> bool:
    """Whether ``filename`` is a connector's code: not kvconn's, pluggy's or the standard library's."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    in_stdlib = path.is_relative_to(_STDLIB) and "site-packages" not in path.parts
    return not (path.is_relative_to(_SDK) or "pluggy" in path.parts or in_stdlib)


def connector_frame(exc: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of ``exc`` in the connector's own code.

    Frames of kvconn itself (the SDK, its host and engine) and of pluggy and
    the standard library are skipped: the frame shown is where the
    connector's author can put a breakpoint.
    """
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if _connector_code(frame.filename)]
    cause = exc.__cause__ or exc.__context__
    if not frames and cause is not None:
        return connector_frame(cause)
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


#: The fix for a connector the host stopped calling because one hook kept running over its time budget.
HOOK_BUDGET_FIX = (
    "take the store I/O out of {hook}, which the engine waits for on every step: start it there and let it "
    "finish in the background (an async load: get_num_new_matched_tokens answers load_async=True and get_finished "
    "reports it; an async save: request_finished returns True until get_finished reports it), or give each call "
    "a deadline under the budget (a kvconn store connector: timeout_s below it, so that its store is taken off "
    "and probed instead); only if this engine can afford to wait that long every step, raise the host's "
    "hook_budget_s (vLLM: kvconn_hook_budget_s in kv_connector_extra_config)"
)


def _over_budget(exc: BaseException | None) -> HookOverBudget | None:
    """The host's :class:`~kvconn.errors.HookOverBudget` that ``exc`` is or was raised from, if any."""
    while exc is not None and not isinstance(exc, HookOverBudget):
        exc = exc.__cause__
    return exc


def _ask(driver: object, method: str) -> list[Any]:
    """``driver.method()`` when the driver offers it (:class:`WaitsReporter`), else nothing."""
    answer = getattr(driver, method, None)
    return list(answer()) if callable(answer) else []


def diagnose_error(exc: BaseException, driver: object, where: str, setting: str) -> Diagnosis:
    """What to report for ``exc``, raised ``where`` (a run and step) in a run set up as ``setting``.

    A connector error shows the frame in the connector's own code and the
    situation the run created at that step; a stall, who waits for what.
    """
    if isinstance(exc, Stalled):
        return Diagnosis(f"{where}: {exc}", exc.fix)
    slow = _over_budget(exc)
    if slow is not None:  # the host's own doing: no frame of the connector raised, its hooks were too slow
        return Diagnosis(
            f"the host stopped calling the connector in {where}: {slow.calls} calls of {slow.hook} in a row took "
            f"longer than its hook budget of {slow.budget_s:g} s (the last {slow.seconds:.3f} s), and the engine "
            "waits for every hook before its step goes on",
            HOOK_BUDGET_FIX.format(hook=slow.hook),
        )
    observed = f"the connector raised in {where}: {type(exc).__name__}: {exc}"
    engine = engine_failure(exc, where)
    if engine is not None:
        return engine
    frame = connector_frame(exc)
    if frame is None:
        return Diagnosis(observed)
    facts = _ask(driver, "situation")
    at_step = "; ".join(facts) if facts else setting
    observed += f", at {frame}; that step: {at_step}"
    hook = getattr(exc, "hook", "the hook")
    return Diagnosis(observed, f"make {hook} ({frame.split(' in ')[0]}) cope with what that step had: {at_step}")


#: Where an engine's own code lives (its scheduler, workers and engine core, kvconn's reference engine): an
#: exception raised there is the engine failing, whatever the connector did to cause it.
_ENGINE_CODE = ("/vllm/v1/core/", "/vllm/v1/worker/", "/vllm/v1/engine/", "/kvconn/reference/")
#: An engine assertion a connector's answer causes (the failing line, stripped), and the cause in the
#: connector's terms, with its fix.
_ENGINE_CAUSES = {
    "assert num_new_tokens > 0": (
        "get_num_new_matched_tokens claimed every token of a prompt (a synchronous load), leaving the engine no "
        "token to compute, so it cannot schedule the request",
        "leave at least one prompt token to compute: claim at most (request.num_tokens - 1) // block_size * "
        "block_size tokens (num_computed_tokens included)",
    ),
}


def engine_failure(exc: BaseException, where: str) -> Diagnosis | None:
    """The engine's own exception, where it was raised, and its cause in the connector's terms where known.

    ``None`` when ``exc`` was not raised in the engine's code (the connector's frame then says where).
    """
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not any(part in frames[-1].filename.replace("\\", "/") for part in _ENGINE_CODE):
        return None
    frame = frames[-1]
    line = (frame.line or "").strip()
    observed = (
        f"the engine raised in {where}: {type(exc).__name__}: {exc}, at {frame.filename}:{frame.lineno} in "
        f"{frame.name}: {line}"
    )
    cause = _ENGINE_CAUSES.get(line)
    if cause is None:
        return Diagnosis(f"{observed}: an answer of the connector broke the engine's invariant there")
    return Diagnosis(f"{observed}: {cause[0]}", cause[1])
