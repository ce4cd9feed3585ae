"""``KVConnVllmConnector``: kvconn connectors behind vLLM's ``KVConnectorBase_V1``.

One instance serves one vLLM role and owns a :class:`kvconn.ConnectorHost` of
that role, built from ``kv_transfer_config.kv_connector_extra_config``
(:mod:`.config`). The class is a thin shell, as vLLM's own Mooncake store
connector is: each call vLLM makes goes to the role's side,
:class:`~.scheduler.KVConnVllmScheduler` (``connector_scheduler``) or
:class:`~.worker.KVConnVllmWorker` (``connector_worker``), which forwards it to
the host with vLLM's types translated at that boundary (:mod:`.translate`).
What crosses processes is plain data (:mod:`.metadata`):

* scheduler -> workers: :class:`KVConnVllmMetadata` (pickled by vLLM's
  ``MessageQueue``): each connector's metadata as msgpack bytes
  (:func:`kvconn.host.wire.encode_metadata`) and the blocks of the loads in flight;
  on an idle step (every connector's metadata its ``Metadata()`` default, no load
  in flight, no report awaited: most decode steps) a :data:`IdleStep` instead;
* workers -> scheduler: :class:`KVConnVllmWorkerMetadata` (vLLM's
  ``kv_connector_worker_meta``): one :class:`~.reports.WorkerReport` per worker.

Load failures reach vLLM as ``invalid_block_ids`` *in the step that ran on
them*, because vLLM handles invalid blocks before it calls
``update_connector_output``: the scheduler lists each connector's loads in the
metadata, and a worker whose connector raised, or got no metadata, reports
that connector's load blocks itself. vLLM then recomputes or fails the
request according to ``kv_load_failure_policy`` (use ``"recompute"``).

With several KV-cache groups, vLLM 0.33 takes no invalid blocks (block ids are
unique only within a group: ``Scheduler._handle_invalid_blocks`` raises) and
takes a failed load per request, in ``KVConnectorTransferResults.failed_recving``,
for async loads only (``Scheduler._handle_failed_recving`` acts on requests in
``WAITING_FOR_REMOTE_KVS``). So there every load is async to vLLM (a connector's
sync load still runs in the worker step its metadata reaches, and ends with it),
and a load that ended with a failed block is held back one step: the scheduler
lists it in ``failed_loads``, and the workers report it in ``failed_recving``
and ``finished_recving`` (both, as vLLM's ``KVOutputAggregator`` requires). vLLM
then recomputes the request from its first token (``_update_waiting_for_remote_kv``
frees its blocks and asks the connector again).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvconn.host import SchedulerHost, WorkerHost

from .compat import SupportsHMA
from .config import check_extra_config, hosted_connectors
from .metadata import IdleStep, KVConnVllmMetadata, KVConnVllmStats, KVConnVllmWorkerMetadata
from .registration import route_logs_to_vllm
from .scheduler import KVConnVllmScheduler
from .telemetry import ConnectorTelemetry, prom_metrics_class
from .worker import KVConnVllmWorker

__all__ = ["IdleStep", "KVConnVllmConnector", "KVConnVllmMetadata", "KVConnVllmStats", "KVConnVllmWorkerMetadata"]


class KVConnVllmConnector(KVConnectorBase_V1, SupportsHMA):
    """Hosts kvconn connectors for one vLLM role; see the module docstring.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``): kvconn
    connectors always see one table per KV-cache group, with vLLM's null
    block (id 0, as kvconn's ``NULL_BLOCK_ID``) where a sliding window freed
    a block.
    """

    #: The role's side (named as vLLM's own connectors name theirs); the other role's is never set, so a call of
    #: the other role fails on the missing attribute.
    connector_scheduler: KVConnVllmScheduler
    connector_worker: KVConnVllmWorker

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_logs_to_vllm()
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        worker = role == KVConnectorRole.WORKER
        self.host, self.context = hosted_connectors(vllm_config, kv_cache_config, extra, worker=worker)
        telemetry = {n: ConnectorTelemetry.of(type(c)) for n, c in self.host.connectors.items()}
        self._side: KVConnVllmScheduler | KVConnVllmWorker
        if isinstance(self.host, WorkerHost):
            self._side = self.connector_worker = KVConnVllmWorker(self.host, self.context, telemetry)
        elif isinstance(self.host, SchedulerHost):
            # Events only when vLLM publishes them: a connector records none until its take_events is first called.
            events_config = getattr(vllm_config, "kv_events_config", None)
            self._side = self.connector_scheduler = KVConnVllmScheduler(
                self.host,
                self.context,
                vllm_config,
                telemetry,
                publishes_events=bool(getattr(events_config, "enable_kv_cache_events", False)),
            )

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        return self.connector_scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def take_events(self) -> Any:
        return self.connector_scheduler.take_events()

    def build_connector_meta(self, scheduler_output: Any) -> KVConnVllmMetadata | IdleStep:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def sent_metadata(self, sent: KVConnVllmMetadata | IdleStep, name: str) -> bytes | None:
        """Connector ``name``'s metadata, encoded, in what :meth:`build_connector_meta` returned (``None``: none sent).

        On an idle step, the encoding of its ``Metadata()`` default: what its workers decode. For tools that
        check what a connector sent (``kvconn validate --engine vllm``).
        """
        return self.connector_scheduler.sent_metadata(sent, name)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with one KV-cache group (its hybrid manager off)."""
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager: the request's table in every group."""
        return self.connector_scheduler.request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Begin the step, and start its loads here (see :meth:`~.worker.KVConnVllmWorker.bind_connector_metadata`)."""
        super().bind_connector_metadata(connector_metadata)
        self.connector_worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing to do: the step's loads started when its metadata was bound."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.connector_worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.connector_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.connector_worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.connector_worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnVllmWorkerMetadata | None:
        return self.connector_worker.build_connector_worker_meta()

    # ---------------------------------------------------------------------- both

    def get_kv_connector_stats(self) -> KVConnVllmStats | None:
        """What happened since the last call (vLLM asks each step, on both sides, and sums them per interval)."""
        return self._side.get_kv_connector_stats()

    def shutdown(self) -> None:
        self.host.shutdown()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnVllmStats | None:
        return KVConnVllmStats(data=dict(data)) if data is not None else None

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any) -> Any:
        """``vllm:kvconn_*`` series per connector (:mod:`.telemetry`), made in vLLM's front end."""
        return prom_metrics_class()(vllm_config, *args)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """vLLM's earliest call with the connector's config: the front end's config check, with full CUDA graphs.

        kvconn checks ``kv_connector_extra_config`` here (keys, connector names,
        their configs): a mistake stops ``vllm serve`` before an engine starts.
        Elsewhere vLLM first hands the config to the connector's constructor,
        after the model has loaded.
        """
        check_extra_config(dict(extra_config or {}))
        return bool(super().requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """vLLM's first call with the config where no front-end call has it (a CPU engine; no full CUDA graphs).

        vLLM 0.32 and 0.33 ask it once, in the engine core, when they resolve the
        KV-cache layout: after the weights load, before memory profiling, warm-up,
        and before any worker builds a connector. kvconn checks
        ``kv_connector_extra_config`` here too, so a mistake stops the engine
        there, in one process, instead of in every worker's connector.
        """
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        check_extra_config(dict(getattr(transfer, "kv_connector_extra_config", None) or {}))
        return super().get_required_kvcache_layout(vllm_config)
