"""The conformance session for a vLLM connector: which checks apply, and the drivers they run on.

:class:`NativeSession` is a :class:`~kvconn.testing.conformance.session.Session` whose drivers are the native
ones (:class:`~.native_driver.NativeDriver`, and for the data checks :class:`~.native_data.NativeDataDriver`).
Checks that do not apply to a vLLM connector are reported skipped with the reason (:data:`NOT_APPLICABLE`); KV021
judges the pickled metadata (:mod:`.wire`) instead of kvconn's msgspec round trip.

Read by :mod:`.native` (the ``--vllm-connector`` entry point) and tests; a check added to kvconn's catalogue that
cannot apply to a vLLM connector goes in :data:`NOT_APPLICABLE`, and docs/checks.md says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvconn.testing.conformance.catalog import Check
from kvconn.testing.conformance.checks.data import failed_load_recomputed
from kvconn.testing.conformance.driver import DriverSpec
from kvconn.testing.conformance.results import CheckResult, Violation
from kvconn.testing.conformance.session import Session

from .native_data import NativeDataDriver
from .native_driver import NativeDriver
from .native_observer import NativeStepRecord
from .native_target import NativeTarget
from .stand_ins import stand_in_for

__all__ = ["NOT_APPLICABLE", "NativeSession"]

_PACKAGING = "a kvconn packaging check (entry points, a msgspec Config, pluggy hooks); a vLLM connector has none"
#: Checks that do not apply to a vLLM connector, and why (reported as skipped with this reason).
NOT_APPLICABLE: dict[str, str] = {
    "KV001": _PACKAGING,
    "KV002": _PACKAGING,
    "KV003": _PACKAGING,
    "KV004": _PACKAGING,
    "KV005": _PACKAGING,
    "KV006": _PACKAGING,
    "KV013": "a kvconn-only contract (an engine may offer fewer requests than it schedules): vLLM offers every "
    "scheduled request",
    "KV020": "kvconn's msgspec round trip; a vLLM connector's metadata crosses with pickle, checked by KV021",
}
#: Why the data checks do not apply to a connector run with a stand-in worker.
_STAND_IN_DATA = "its worker here is a stand-in that moves no KV, so the data checks have nothing to judge"


class _NativeFactory:
    """A session's drivers for a vLLM connector: :class:`NativeDriver`, and the data checks' (``data_driver``)."""

    def __init__(self, target: NativeTarget) -> None:
        self.target = target

    def __call__(self, spec: DriverSpec) -> NativeDriver:
        return NativeDriver(spec, self.target)

    def data_driver(self, spec: DriverSpec, **options: Any) -> NativeDataDriver:
        """:class:`~.native_data.NativeDataDriver` (``options``: its keywords)."""
        return NativeDataDriver(spec, self.target, **options)


class NativeSession(Session):
    """A :class:`~kvconn.testing.conformance.session.Session` for a vLLM connector.

    Serves both roles. A vLLM connector does not say whether it saves and
    loads: the data checks run on it (their data runs need both) unless its
    worker is a stand-in that moves no KV (:data:`~.stand_ins.STAND_IN_WORKERS`).
    """

    def __init__(self, target: NativeTarget, config: Mapping[str, Any] | None = None) -> None:
        self.target = target
        self.connector = target.name
        self.config = dict(config) if config is not None else None
        self.config_factory = None
        self.driver_name = "vllm"
        self.factory = _NativeFactory(target)
        self.cls = target.cls
        self.config_error = None
        self.stand_in = stand_in_for(target.cls, self.config)
        self.every_data_run_loads = False  # see Session.every_data_run_loads
        moves_kv = self.stand_in is None or self.stand_in.moves_kv
        self.capabilities = frozenset({"scheduler", "worker", *(("saves", "loads") if moves_kv else ())})
        self._start()

    def _run(self, check: Check) -> CheckResult:
        reason = NOT_APPLICABLE.get(check.id)
        if reason is None and "saves" in check.requires and "saves" not in self.capabilities:
            reason = _STAND_IN_DATA
        if reason is not None:
            return CheckResult(check.id, check.name, "skipped", f"does not apply to a vLLM connector: {reason}")
        if "saves" in check.requires:  # after the scenarios: a connector that cannot start fails KV010 alone
            check = replace(check, after=(*check.after, "KV010"))
        if check.id == "KV041":  # its second part reruns the worker as a kvconn plugin in a process of its own
            check = replace(check, function=failed_load_recomputed)
        if check.id == "KV021":  # pickled, not msgspec: the objects pickling met, not the plain view's types
            check = replace(check, function=_metadata_pickles_plain)
        if check.id == "KV011" and not _lazy_block_state():
            check = replace(check, fix=f"{check.fix}. {_DICT_FORM_FIX}")
        return super()._run(check)


_DICT_FORM_FIX = (
    "This vLLM's kv_connector_block_state.block_ids holds only the requests that got new blocks this step, so "
    "a connector reading it finds no table on the block-fill step: use vLLM 0.30 or later (its lazy block state "
    "offers every scheduled request), or keep each request's table from scheduled_new_reqs and new_block_ids"
)


def _lazy_block_state() -> bool:
    """Whether this vLLM's block state is the lazy form (0.30+: ``req_ids``), not 0.29's dict."""
    from vllm.v1.core.sched.output import KVConnectorBlockState

    return "req_ids" in getattr(KVConnectorBlockState, "__annotations__", {})


def _metadata_pickles_plain(session: Session) -> None:
    """KV021 for a vLLM connector: no scheduler-side object in the metadata vLLM pickles for its workers."""
    for trace in session.completed_traces():
        for record in trace.records:
            found = record.engine_objects if isinstance(record, NativeStepRecord) else []
            if found:
                raise Violation(
                    f"in {trace.where()}, step {record.step}: the metadata vLLM pickles for the workers holds "
                    f"{'; '.join(found)}"
                )
