"""The workers' host: caches registered, a step's metadata bound, the per-layer hooks, and each step's report.

A worker side that raises sits out the rest of the step (its loads are
reported failed, so the scheduler recomputes them); one whose
``register_kv_caches`` failed, or that was degraded for being slow, sits
out every step. The per-layer hooks run layers x connectors times a step,
so who takes part is planned once per step (and again on a failure) and
each call is a plain loop over a ready list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from time import perf_counter
from typing import Any

from ..connector import KVConnectorRole
from ..errors import ConnectorConfigError
from ..hookspecs import WORKER_HOOKS
from ..metadata import KVConnectorMetadata
from ..outputs import KVConnectorOutput
from . import answers
from .connector_host import ConnectorHost

__all__ = ["WorkerHost"]


class WorkerHost(ConnectorHost, role=KVConnectorRole.WORKER):
    """The host of an engine's worker (arguments as for :class:`~kvconn.ConnectorHost`)."""

    hooks = WORKER_HOOKS

    def _init_role(self) -> None:
        self._skip = self._failed_this_step  # a connector that failed sits out the rest of the step
        self._metadata: dict[str, KVConnectorMetadata] = {}  # this step's, per connector
        # A step's calls of hooks nobody implements are skipped whole (most steps of most connectors).
        self._layered = any(self._impls.get(h) for h in ("start_load_kv", "save_kv_layer", "wait_for_layer_load"))
        self._reporting = any(
            self._impls.get(h) for h in ("get_finished", "get_block_ids_with_load_errors", "get_kv_connector_stats")
        )
        self._plan_layers()

    def _fail(self, name: str, hook: str, exc: Exception) -> None:
        super()._fail(name, hook, exc)
        self._plan_layers()  # it sits out the rest of the step

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """A connector that fails here is disabled: every step reports it failed (loads recompute).

        A :class:`~kvconn.errors.ConnectorConfigError` is raised instead: the
        config does not fit this engine (a pool smaller than one block, say),
        which only the operator can fix; running without the connector would hide it.
        """
        for name, call in self._impls["register_kv_caches"]:
            try:
                call(kv_caches)
            except ConnectorConfigError:
                raise
            except Exception as exc:
                self._fail(name, "register_kv_caches", exc)
        self._disabled |= self._failed_this_step

    def bind_connector_metadata(self, metadata: Mapping[str, KVConnectorMetadata] | None) -> None:
        """This step's metadata; a connector without an entry sits the step out."""
        self._metadata = dict(metadata or {})
        if self._layered:
            self._plan_layers()

    def _plan_layers(self) -> None:
        """Decide once per step (and again when a connector fails) who takes part in the per-layer hooks.

        They run layers x connectors times a step, so each call is a plain loop
        over a ready list: connectors that have not failed and, for the hooks
        taking it, have metadata this step, paired with that metadata.
        """
        failed, metadata = self._failed_this_step, self._metadata

        def with_metadata(hook: str) -> list[tuple[str, Callable[..., Any], KVConnectorMetadata]]:
            return [(n, c, metadata[n]) for n, c in self._impls.get(hook, ()) if n not in failed and n in metadata]

        self._kv_loads = [(n, c, (m,)) for n, c, m in with_metadata("start_load_kv")]  # the arguments of _call
        self._layer_saves = with_metadata("save_kv_layer")
        self._layer_waits = [(n, c) for n, c in self._impls.get("wait_for_layer_load", ()) if n not in failed]

    # start_load_kv runs once a step: each connector's call guarded and timed on its own (HostCore._call). The
    # per-layer hooks run layers x connectors times a step: each loop is timed as a whole (two clock reads per
    # layer, whatever the number of connectors), and a slow call is put down to every connector that took part.

    def start_load_kv(self) -> None:
        for name, call, args in self._kv_loads:
            self._call(name, call, "start_load_kv", args, None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        started = perf_counter()
        for name, call in self._layer_waits:
            try:
                call(layer_name)
            except Exception as exc:
                self._fail(name, "wait_for_layer_load", exc)
        if (elapsed := perf_counter() - started) > self.hook_budget_s:
            self._slow_layer(self._layer_waits, "wait_for_layer_load", elapsed)
        elif self._slow_in_a_row:
            self._layer_in_budget(self._layer_waits, "wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        started = perf_counter()
        for name, call, metadata in self._layer_saves:
            try:
                call(layer_name, kv_layer, metadata)
            except Exception as exc:
                self._fail(name, "save_kv_layer", exc)
        if (elapsed := perf_counter() - started) > self.hook_budget_s:
            self._slow_layer(self._layer_saves, "save_kv_layer", elapsed)
        elif self._slow_in_a_row:
            self._layer_in_budget(self._layer_saves, "save_kv_layer")

    def _slow_layer(self, taking_part: Sequence[tuple[Any, ...]], hook: str, seconds: float) -> None:
        for entry in list(taking_part):  # a connector degraded here leaves the list (its layers are re-planned)
            self._slow(entry[0], hook, seconds)

    def _layer_in_budget(self, taking_part: Sequence[tuple[Any, ...]], hook: str) -> None:
        for entry in taking_part:
            self._in_budget(entry[0], hook)

    def wait_for_save(self) -> None:
        if self._impls["wait_for_save"]:
            self._notify("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> dict[str, KVConnectorOutput]:
        """Collect each connector's report for this step and end the step.

        A connector left out reported nothing: on the usual step (no connector
        implements a reporting hook, none failed) the result is empty, so that
        an engine pays nothing per connector for a step without news. A report
        of the wrong type (not sets of request ids, block ids and numeric
        stats) is a bad answer: that connector's step failed.
        """
        if not self._reporting and not self._failed_this_step:
            self._metadata = {}
            if self._layered:
                self._plan_layers()
            return {}
        outputs = {name: KVConnectorOutput() for name in self.connectors}
        if self._reporting:
            for name, (sending, recving) in self._each("get_finished", (finished_req_ids,), answers.finished):
                outputs[name].finished_sending, outputs[name].finished_recving = sending, recving
            for name, errors in self._each("get_block_ids_with_load_errors", (), answers.block_ids):
                outputs[name].invalid_block_ids = errors
            for name, stats in self._each("get_kv_connector_stats", (), answers.stats):
                outputs[name].stats = stats
        for name in self._failed_this_step:
            outputs[name].failed = True
        self._failed_this_step.clear()  # in place: it is the set dispatch skips
        self._failed_this_step |= self._disabled
        self._metadata = {}
        if self._layered:
            self._plan_layers()
        return outputs
