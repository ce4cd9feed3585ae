"""Stand-ins for vLLM connectors' workers that cannot run here (on the CPU, without their services).

A worker that needs CUDA or a service is replaced by a stand-in worker connector that reports completions as the
real one does (``MooncakeStoreConnector``), or runs on a stand-in at a seam of its own (``OffloadingConnector``: an
``OffloadingSpec``, :mod:`.offloading_standin`); :data:`STAND_IN_WORKERS` says which, and the report says so
(:meth:`StandIn.note`).

Read by :mod:`.native_observer` (which worker runs) and :mod:`.native_session` (which checks apply, the note). A
new stand-in goes in :data:`STAND_IN_WORKERS` and in docs/vllm.md's list of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STAND_IN_WORKERS", "StandIn", "stand_in_for"]


def _mooncake_store_stand_in() -> type:
    """A worker for ``MooncakeStoreConnector`` that reports what its real worker reports, moving no data.

    Derived from vLLM's ``MooncakeStoreWorker``: each save job of the step's
    metadata (``ReqMeta.can_save``, numbered ``store_job_id`` by the
    scheduler side) is reported done in ``MooncakeStoreWorkerMetadata.completed_saves``
    (``build_connector_worker_meta``, one rank), and each async load
    (``load_spec.can_load``) in ``get_finished``'s finished receiving, on the
    step after it started, as its receive threads do. The real worker copies
    through ``torch.cuda.Event`` and a ``MooncakeDistributedStore``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeStoreWorkerMetadata

    class MooncakeStoreStandInWorker(KVConnectorBase_V1):
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self._saves: dict[int, int] = {}
            self._recving: set[str] = set()
            self._recved: set[str] = set()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            for req in self._get_connector_metadata().requests:
                if req.load_spec is not None and req.load_spec.can_load:
                    self._recving.add(req.req_id)

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None

        def wait_for_save(self) -> None:
            for req in self._get_connector_metadata().requests:
                if req.can_save and req.store_job_id is not None:
                    self._saves[req.store_job_id] = 1

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            done, self._recved, self._recving = self._recved, self._recving, set()
            return None, done or None

        def build_connector_worker_meta(self) -> Any:
            saves, self._saves = self._saves, {}
            return MooncakeStoreWorkerMetadata(completed_saves=saves) if saves else None

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            raise NotImplementedError  # worker role only

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            raise NotImplementedError

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            raise NotImplementedError

    return MooncakeStoreStandInWorker


@dataclass(frozen=True)
class StandIn:
    """A stand-in for a worker that cannot run here: why, what stands in, and the config it needs.

    ``worker`` builds a worker connector that replaces the connector's own
    (it moves no KV: the data checks do not apply). ``None``: the connector's
    own worker runs, on a stand-in that ``config`` plugs in at a seam vLLM
    offers (``moves_kv``: it copies real KV, so the data checks apply).
    """

    why: str
    worker: Callable[[], type] | None
    #: config defaults under the stand-in (a user's config wins), with what they leave out
    config: Mapping[str, Any] = field(default_factory=dict)
    leaves_out: str = ""
    #: the report's words for what stands in (default: the stand-in worker's class name)
    describes: str = ""
    moves_kv: bool = False
    #: config keys with which a user picks their own instead (then the stand-in is not used)
    overridden_by: tuple[str, ...] = ()

    def note(self) -> str:
        """The report's ``note:`` line."""
        what = self.describes or (
            f"a stand-in ({self.worker().__name__}) that reports completions as the real one does"
            if self.worker is not None
            else "a stand-in"
        )
        return (
            f"worker: {what}; the real one cannot run here: {self.why}"
            + ("" if self.moves_kv else "; the checks judge the scheduler side")
            + (f"; {self.leaves_out}" if self.leaves_out else "")
        )


#: ``OffloadingConnector``'s config for its stand-in spec (:mod:`.offloading_standin`); ``cpu_bytes_to_use``:
#: room for every block the conformance runs save, so nothing is evicted.
_OFFLOADING_STAND_IN = {
    "spec_name": "CPUStandInOffloadingSpec",
    "spec_module_path": "kvconn_vllm.testing.offloading_standin",
    "cpu_bytes_to_use": 32 * 1024 * 1024,
}

#: Connector class names whose worker cannot run here, and what stands in for it.
STAND_IN_WORKERS: dict[str, StandIn] = {
    "MooncakeStoreConnector": StandIn(
        "its worker copies through torch.cuda.Event and a MooncakeDistributedStore (CUDA and a Mooncake master)",
        _mooncake_store_stand_in,
        {"enable_lookup": False},
        "lookups go to the real worker's ZMQ lookup server, so enable_lookup is off: saves are judged, loads are not",
    ),
    "OffloadingConnector": StandIn(
        "CPUOffloadingSpec.get_worker needs CUDA or XPU (its CPUOffloadingWorker copies through CUDA streams "
        "and events)",
        None,
        _OFFLOADING_STAND_IN,
        describes="vLLM's own OffloadingConnector worker and CPUOffloadingManager, on a stand-in spec "
        "(CPUStandInOffloadingSpec, kvconn_vllm.testing.offloading_standin, plugged in by spec_name and "
        "spec_module_path as vLLM's own tests plug in theirs): vLLM's CPUOffloadingSpec whose worker makes "
        "CPUOffloadingWorker's block copies on the CPU, at submission",
        moves_kv=True,
        overridden_by=("spec_name", "spec_module_path"),
    ),
}


def stand_in_for(cls: type, config: Mapping[str, Any] | None = None) -> StandIn | None:
    """What stands in for the worker of ``cls`` (or of the vLLM connector it subclasses) under the user's
    ``config``, if its worker needs a stand-in and the config does not pick its own."""
    for klass in cls.__mro__:
        if klass.__name__ in STAND_IN_WORKERS and klass.__module__.startswith("vllm."):
            stand_in = STAND_IN_WORKERS[klass.__name__]
            return None if any(key in (config or {}) for key in stand_in.overridden_by) else stand_in
    return None
