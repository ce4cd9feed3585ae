"""Diagnosis: from what a run showed to the mechanism that broke it, and the fix for that mechanism.

A check knows *that* something went wrong (the tokens differ, nothing can be
scheduled, a hook raised); these helpers say *why*, in the terms of the
connector's own code: which request waits for which report and since which
answer, which frame of the connector raised and in what situation.
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "Awaited",
    "Diagnosis",
    "Stalled",
    "WaitsReporter",
    "connector_frame",
    "diagnose_error",
    "shifted_pairing",
    "stall",
    "transfer_kind",
]


@dataclass(frozen=True)
class Awaited:
    """A report the engine waits for: ``kind`` (``finished_sending`` / ``finished_recving``) of ``req_id``,
    since ``step``, when the connector's ``answer`` started the wait."""

    req_id: str
    kind: str
    step: int
    answer: str


class WaitsReporter(Protocol):
    """What a driver can say beyond the protocol, for a diagnosis (optional; the reference driver can).

    ``awaited``: the reports its engine still waits for. ``situation``: what
    the step in progress has that a connector may not cope with (null blocks
    in a table, a request resumed after preemption, ...), one phrase each.
    """

    def awaited(self) -> list[Awaited]: ...

    def situation(self) -> list[str]: ...


@dataclass(frozen=True)
class Diagnosis:
    """What a failed run observed, and the fix for that mechanism (``None``: the check's own)."""

    observed: str
    fix: str | None = None


#: The fix for a wait that never ends, per report kind.
_FIXES = {
    "finished_sending": "report {ids} in get_finished's finished_sending (once) as soon as the save that made "
    "request_finished return True no longer reads its blocks; return False from request_finished when no save "
    "of the request is pending",
    "finished_recving": "report {ids} in get_finished's finished_recving (once) when the async load started for "
    "it (get_num_new_matched_tokens returned load_async=True) has landed; a load that cannot complete is "
    "reported too, with its blocks in get_block_ids_with_load_errors",
}
_WAITS_FOR = {
    "finished_sending": "its blocks stay held until finished_sending reports it",
    "finished_recving": "it cannot be scheduled until finished_recving reports it",
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
        f"{_WAITS_FOR[first.kind]}, and get_finished never reported it{others}"
    )
    ids = ", ".join(repr(r) for r in [first.req_id, *same])
    return Stalled(f"{what}: {waits}", _FIXES[first.kind].format(ids=ids))


def connector_frame(exc: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of ``exc`` in the connector's own code.

    Frames of kvconn itself (the SDK, its host and engine) and of pluggy and
    the standard library are skipped: the frame shown is where the
    connector's author can put a breakpoint.
    """
    sdk = Path(__file__).resolve().parents[2]  # the kvconn package
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not Path(frame.filename).resolve().is_relative_to(sdk)
        and "pluggy" not in Path(frame.filename).parts
        and not frame.filename.startswith("<")
        and "/lib/python3" not in frame.filename.replace("site-packages", "")
    ]
    cause = exc.__cause__ or exc.__context__
    if not frames and cause is not None:
        return connector_frame(cause)
    if not frames:
        return None
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


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
    observed = f"the connector raised in {where}: {type(exc).__name__}: {exc}"
    frame = connector_frame(exc)
    if frame is None:
        return Diagnosis(observed)
    facts = _ask(driver, "situation")
    at_step = "; ".join(facts) if facts else setting
    observed += f", at {frame}; that step: {at_step}"
    hook = getattr(exc, "hook", "the hook")
    return Diagnosis(observed, f"make {hook} ({frame.split(' in ')[0]}) cope with what that step had: {at_step}")


def transfer_kind(path: str) -> str:
    """``"load"``, ``"save"`` or ``"transfer"``: what the metadata field at ``path`` (``metadata.loads[2]``) is."""
    lowered = path.lower()
    if "load" in lowered or "recv" in lowered:
        return "load"
    if any(word in lowered for word in ("save", "store", "put", "send")):
        return "save"
    return "transfer"


def shifted_pairing(
    where: str, path: str, req_id: str, block_id: int, index: int, table: Sequence[Sequence[int]]
) -> Diagnosis | None:
    """A block id paired with the hash of block ``index`` that sits at another position of the live table.

    For a request whose table was never replaced (no preemption), that is an
    index off by the distance between the two positions, in a load (the
    bytes saved for block ``index`` land in another block) or in a save (the
    bytes of another block are stored under block ``index``'s hash).
    """
    at = next((j for group in table for j, b in enumerate(group) if b == block_id), None)
    if at is None:
        return None
    kind, shift = transfer_kind(path), at - index
    direction = f"{abs(shift)} position{'s' if abs(shift) != 1 else ''} {'later' if shift > 0 else 'earlier'}"
    what = {
        "load": f"the bytes saved for block {index} are written into the block at position {at}, {direction}",
        "save": f"the bytes of the block at position {at} are stored under the hash of block {index}, {direction}",
        "transfer": f"block {index}'s hash travels with the block at position {at}, {direction}",
    }[kind]
    observed = (
        f"{where}: a {kind} ({path}) pairs block {block_id} with the hash of block {index} of {req_id}, but block "
        f"{block_id} is at position {at} of its live table {table}: {what}"
    )
    sign = "+" if shift > 0 else "-"
    fix = (
        f"in the {kind}, pair the hash of block i with the block id at position i of the table "
        f"(block_ids[group][i]): the {kind} takes its block ids {direction} than their hashes; look for a "
        f"'{sign} {abs(shift)}' in the index where the {kind}'s block ids are taken from the table"
    )
    return Diagnosis(observed, fix)
