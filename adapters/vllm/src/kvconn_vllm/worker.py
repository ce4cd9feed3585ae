"""The worker side of :class:`~.connector.KVConnVllmConnector`: vLLM's worker calls, on a ``WorkerHost``.

:class:`KVConnVllmWorker` decodes the scheduler's :class:`~.metadata.KVConnVllmMetadata` (or
:data:`~.metadata.IdleStep`), runs kvconn's worker step contract whatever order vLLM calls in (``start_load_kv``
first, as soon as the metadata is bound; each layer's load and save; ``wait_for_save`` once; ``get_finished``),
and reports each connector's output to the scheduler in a :class:`~.reports.WorkerReport`, with the failed loads
vLLM must learn of in the step that ran on them (see :mod:`.connector`'s docstring).

Read by :mod:`.connector` only (the shell vLLM loads). A change to what it reads must match :mod:`.scheduler`,
which sends it; the vLLM tiers (``tests/vllm``, ``tests/vllm_029``) and ``benchmarks/vllm_step_overhead.py`` (its
per-step cost) are what check it.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

from kvconn.context import ConnectorContext
from kvconn.errors import WireError
from kvconn.host import LoadSpec, WorkerHost
from kvconn.host.wire import decode_metadata
from kvconn.metadata import KVConnectorMetadata as KVConnMetadata
from kvconn.outputs import KVConnectorOutput

from .compat import HAS_WORKER_META, KVConnectorTransferResults, fails_per_request
from .metadata import NO_BLOCKS, NO_IDS, UNBOUND, KVConnVllmMetadata, KVConnVllmStats, KVConnVllmWorkerMetadata
from .reports import WorkerReport, encode_report
from .telemetry import ConnectorTelemetry, StepStats
from .translate import check_kv_caches

__all__ = ["KVConnVllmWorker"]

logger = logging.getLogger("kvconn.vllm")


def _failed_loads(loads: dict[str, LoadSpec]) -> tuple[set[str], set[int]]:
    """The async ones of loads that no connector will do, and all their blocks (reported invalid)."""
    return {r for r, (_, is_async) in loads.items() if is_async}, {b for blocks, _ in loads.values() for b in blocks}


class KVConnVllmWorker:
    """vLLM's worker-side connector calls, translated for ``host`` (see the module docstring).

    ``telemetry``: each hosted connector's declarations (which of its stats are gauges).
    """

    def __init__(self, host: WorkerHost, context: ConnectorContext, telemetry: dict[str, ConnectorTelemetry]) -> None:
        self.host, self.context = host, context
        self._telemetry = telemetry
        # several groups under a vLLM with failed_recving: failed loads go per request (see .connector's docstring)
        self._per_request = fails_per_request(len(context.kv_cache_groups))
        # metadata is decoded only for connectors with a worker hook that takes it
        self._readers = set(host.implementers("start_load_kv") + host.implementers("save_kv_layer"))
        self._bound = UNBOUND
        self._undecoded: list[str] = []
        self._report: WorkerReport | None = None
        # Kept between a step's end and vLLM's calls for them: read-only (replaced, never changed in place).
        self._invalid: set[int] | frozenset[int] = NO_BLOCKS
        self._failed_recving: set[str] | frozenset[str] = NO_IDS
        self._stats = StepStats(host)  # the connectors' counters, and the seconds of each step's loads and saves
        self._timed: list[str] = []  # the connectors with work in this worker step: its seconds are theirs
        self._saved = True  # no step open until metadata is bound
        self._late_layer_logged = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.host.register_kv_caches(check_kv_caches(kv_caches, self.context))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Begin the step, and start its loads here: kvconn's worker step contract.

        vLLM calls its own ``start_load_kv`` before the forward only when the
        step has synchronous loads, and otherwise after it, after every
        ``save_kv_layer``. kvconn guarantees plugins ``start_load_kv`` first
        (:mod:`kvconn.hookspecs`), so the step starts as soon as its metadata
        is bound, before any layer, whatever order vLLM uses.
        """
        if self._undecoded:
            self._undecoded = []
        if isinstance(connector_metadata, tuple):  # an idle step: the named connectors' metadata is the default
            self._bound = UNBOUND
            types = self.host.metadata_types
            self._begin_step({n: types[n]() for n in connector_metadata if n in self._readers} if self._readers else {})
            return
        self._bound = connector_metadata if isinstance(connector_metadata, KVConnVllmMetadata) else UNBOUND
        self._timed = list(self._bound.connectors)  # a step with work: its loads and saves are timed
        decoded: dict[str, KVConnMetadata] = {}
        for name, blob in self._bound.connectors.items() if self._readers else ():
            if name not in self._readers:
                continue
            try:
                decoded[name] = decode_metadata(name, blob, self.host.metadata_types)
            except WireError as exc:
                logger.warning("%s; it sits this step out on this worker", exc)
                self._undecoded.append(name)
        self._begin_step(decoded)

    def _begin_step(self, metadata: dict[str, KVConnMetadata]) -> None:
        self.host.bind_connector_metadata(metadata)
        self._saved = False
        if not self._bound.loads:
            self.host.start_load_kv()
            return
        started = perf_counter()
        self.host.start_load_kv()
        self._stats.observe_seconds(list(self._bound.loads), "load", perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.host.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        if self._saved:  # a layer after the step's wait_for_save (vLLM's draft model): outside the contract
            if not self._late_layer_logged:
                self._late_layer_logged = True
                logger.warning(
                    "vLLM saved layer %r after the step's wait_for_save; such layers are not saved", layer_name
                )
            return
        self.host.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Once a step: vLLM calls it after ``get_finished`` too when a draft model runs (deferred finalize)."""
        if not self._saved:
            self._saved = True
            if not self._timed:
                self.host.wait_for_save()
                return
            started = perf_counter()
            self.host.wait_for_save()
            timed, self._timed = self._timed, []
            self._stats.observe_seconds(timed, "save", perf_counter() - started)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Collect the step's reports; the merged sets go to vLLM only without worker metadata.

        The step's saves are complete first (the contract's order), even when
        vLLM defers its ``wait_for_save`` past this call.
        """
        outputs, failed_async = self._end_step(finished_req_ids)
        if HAS_WORKER_META:
            return None, None
        sending = {r for out in outputs.values() for r in out.finished_sending}
        recving = {r for out in outputs.values() for r in out.finished_recving} | failed_async
        return sending or None, recving or None

    def _end_step(self, finished_req_ids: set[str]) -> tuple[dict[str, KVConnectorOutput], set[str] | frozenset[str]]:
        """End the worker step: its outputs and failed async loads, and what vLLM asks for next, kept.

        Kept: the report (``build_connector_worker_meta``), the invalid blocks
        (``get_block_ids_with_load_errors``) and the stats.
        """
        self.wait_for_save()
        outputs = self.host.get_finished(set(finished_req_ids))
        bound, self._bound = self._bound, UNBOUND
        if not outputs and bound is UNBOUND:  # the usual step: no report, no load, nothing awaited
            self._report, self._invalid, self._failed_recving = None, NO_BLOCKS, NO_IDS
            return outputs, NO_IDS
        for name, loads in bound.loads.items():
            out = outputs.setdefault(name, KVConnectorOutput())
            if out.failed or name in bound.dropped or name in self._undecoded:
                out.failed = True  # the host recomputes its loads; vLLM learns it from the blocks below
                out.invalid_block_ids |= {b for blocks, _ in loads.values() for b in blocks}
        failed_async: set[str] | frozenset[str]
        failed_async, self._invalid = _failed_loads(bound.failed_loads) if bound.failed_loads else (NO_IDS, NO_BLOCKS)
        # A step with nothing to report (the usual one) sends no report, unless the scheduler waits on a
        # transfer: vLLM calls update_connector_output only on a step with a forward or a report.
        news = bool(failed_async) or bound.report
        for name, out in outputs.items():
            if out.is_empty():
                continue
            news = True
            if out.invalid_block_ids:
                self._invalid = self._invalid | out.invalid_block_ids
            # private gauges reach the connector's scheduler side only
            self._stats.add_reported(name, out.stats, self._telemetry[name].gauges, private=False)
        self._report = WorkerReport(outputs, set(failed_async)) if news else None
        if self._per_request:  # vLLM takes these requests' failures, not blocks (see .connector's docstring)
            self._failed_recving, self._invalid = failed_async, NO_BLOCKS
        return outputs, failed_async

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.33's report of a step's transfers: ``get_finished``'s, and the failed loads (several groups).

        A failed load is in ``finished_recving`` too, as ``KVConnectorTransferResults`` requires.
        """
        self._end_step(finished_req_ids)  # a vLLM with transfer results has worker metadata: the sets are its own
        failed, self._failed_recving = self._failed_recving, NO_IDS
        return KVConnectorTransferResults(set(), set(failed), set(failed))

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, NO_BLOCKS
        return set(invalid)

    def get_kv_connector_stats(self) -> KVConnVllmStats | None:
        """The connectors' counters and gauges, the seconds of each step's loads and saves, degraded calls."""
        if not self._stats.data and not self.host.error_counts:
            return None  # the usual step: nothing to take (checked here, a call less on every step)
        data = self._stats.take()
        return KVConnVllmStats(data=data) if data is not None else None

    def build_connector_worker_meta(self) -> KVConnVllmWorkerMetadata | None:
        report, self._report = self._report, None
        return KVConnVllmWorkerMetadata([encode_report(report)]) if report is not None else None
