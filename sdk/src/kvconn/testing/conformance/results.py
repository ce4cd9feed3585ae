"""What a conformance run reports: one result per check, one report per connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "NOT_RUN",
    "CheckResult",
    "CheckSkipped",
    "ConformanceFailure",
    "ConnectorReport",
    "ScenarioBroken",
    "Status",
    "Violation",
    "nothing_preempted",
]

#: How the message of a check skipped because of another check's failure starts.
NOT_RUN = "not run: "

Status = Literal["passed", "failed", "skipped"]


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    ``message`` is empty for a pass; for a failure it reads ``"observed ...;
    fix: ..."``; for a skip it is the reason.
    """

    id: str
    name: str
    status: Status
    message: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "status": self.status, "message": self.message}


@dataclass
class ConnectorReport:
    """Every check's result for one connector.

    ``load_error`` is set (and ``results`` empty) when the connector could
    not be found, imported or configured.
    """

    name: str
    results: list[CheckResult] = field(default_factory=list)
    load_error: str | None = None
    #: What the reader must know to read the results (e.g. a stand-in ran in place of the connector's worker).
    notes: list[str] = field(default_factory=list)

    def _count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    @property
    def passed(self) -> int:
        return self._count("passed")

    @property
    def failed(self) -> int:
        return self._count("failed")

    @property
    def skipped(self) -> int:
        return self._count("skipped")

    @property
    def ok(self) -> bool:
        """No check failed and the connector loaded."""
        return self.load_error is None and self.failed == 0

    def result(self, check_id: str) -> CheckResult:
        """The result of ``check_id`` (``KeyError`` if it did not run)."""
        for r in self.results:
            if r.id == check_id:
                return r
        raise KeyError(check_id)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "failed": self.failed,
            "skipped": self.skipped,
            "checks": [r.to_dict() for r in self.results],
        }
        if self.load_error is not None:
            out["load_error"] = self.load_error
        if self.notes:
            out["notes"] = list(self.notes)
        return out


class ConformanceFailure(AssertionError):
    """Raised by a check: what was observed, and how to fix it.

    ``fix`` is given when the check (or the diagnosis of a run) found the
    mechanism, and so the fix for it; ``None`` leaves the check's own
    (:attr:`~.catalog.Check.fix`) to complete the report (:meth:`report`).
    """

    def __init__(self, observed: str, fix: str | None = None) -> None:
        super().__init__(f"observed {observed}" if fix is None else f"observed {observed}; fix: {fix}")
        self.observed = observed
        self.fix = fix

    def report(self, default_fix: str) -> str:
        """The failure's message, ``"observed ...; fix: ..."``, with ``default_fix`` when it names no fix."""
        return f"observed {self.observed}; fix: {self.fix or default_fix}"


#: The name checks outside the SDK (``kvconn_vllm.testing.native``) raise: the same class.
Violation = ConformanceFailure


class CheckSkipped(Exception):
    """Raised by a check that cannot apply to this connector; the reason is the message."""


def nothing_preempted(run: str) -> CheckSkipped:
    """The skip of a check that judges what happens across preemption, when ``run`` preempted nothing.

    Its requests fill the pool together only if they are admitted together: a connector whose lookups answer
    "ask again" until its server replies (LMCache's MP connector) or whose loads are async admits them steps
    apart, by its timing, and then nobody is preempted. That is the connector's right, not a fault, and nothing
    is left to judge (the suite's own connectors that break these checks keep the run preempting).
    """
    return CheckSkipped(
        f"{run} preempted nothing, so no table was replaced to judge: the connector's answers admitted its requests "
        "steps apart (a lookup answered 'ask again' until its store replied, or an async load); it needs a run in "
        "which a request is preempted (a quicker store, or rerun)"
    )


class ScenarioBroken(ConformanceFailure):
    """The connector raised while a scenario or data run played: a root cause, reported by the first check that
    meets it; the checks that meet it later are not run.

    ``fix`` replaces the check's own when the error says more precisely what is wrong.
    """
