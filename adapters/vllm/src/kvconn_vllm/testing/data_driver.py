"""The data checks (KV040-KV049) through vLLM: its real scheduler, its model-runner code, a model that reads KV.

:class:`VllmDataDriver` is the ``vllm`` driver's ``data_driver``: vLLM's v1
``Scheduler`` (``kv_load_failure_policy="recompute"``) with the connector
behind :class:`~kvconn_vllm.connector.KVConnVllmConnector`, and a worker-side adapter
driven through vLLM's own ``KVConnectorModelRunnerMixin`` and
``maybe_transfer_kv_layer`` on real torch KV caches in vLLM's layout, whose model
is the reference model (:class:`~.model_loop.ModelLoop`): its tokens are the
reference engine's, and a wrong, stale, missing or rearranged load changes them.

Everything that recovers from a failed load is vLLM's (invalid blocks,
``_update_waiting_for_remote_kv`` re-asking the connector); the driver only
injects failures (:class:`~kvconn.testing.conformance.fault_injection.LoadFailures`,
at the hosts) and stops a connector that would never converge
(:class:`~kvconn.testing.conformance.convergence.ConvergenceWatch`). With
``tp_size`` 2 (KV048) every rank runs its shard of the model beside its own
worker-side connector, and each load that lands is audited on every rank
(:class:`~.data_run.VllmDataRunDriver`), so a wrong token is traced as on the
reference engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvconn.host import CallOutcome
from kvconn.testing.conformance.driver import DriverSpec
from kvconn.testing.conformance.fault_injection import FailureMode, watch_data_run
from kvconn.testing.conformance.waits import wait_seconds

from .data_run import VllmDataRunDriver
from .harness import make_scheduler
from .host_observer import HostObserver
from .model_loop import ModelLoop
from .scheduler_driver import vllm_shape

__all__ = ["VllmDataDriver"]


class VllmDataDriver(VllmDataRunDriver):
    """vLLM's scheduler and model-runner code with a model: the data checks' driver (see the module docstring).

    Keywords as :class:`~kvconn.testing.conformance.ReferenceDriver`'s:
    ``fail_loads`` (a :class:`~kvconn.testing.conformance.fault_injection.LoadFailures`
    mode), ``scrub_freed``, ``worker_config`` (the worker side's own config).
    """

    def __init__(
        self,
        spec: DriverSpec,
        *,
        fail_loads: FailureMode | None = None,
        scrub_freed: bool = False,
        worker_config: Mapping[str, Any] | None = None,
    ) -> None:
        import vllm

        shape = vllm_shape(spec.shape)
        scheduler = make_scheduler(spec.connector, spec.config, shape=shape, stall_s=wait_seconds())
        loop = ModelLoop(scheduler, scrub_freed=scrub_freed, worker_config=worker_config)
        super().__init__(spec, shape, loop, HostObserver(spec.connector, scheduler.connector))
        self.name = spec.connector
        host = scheduler.connector.host
        host.add_monitor(after=self._count, calls=("update_state_after_alloc", "update_connector_output"))
        self.failures = watch_data_run(
            self.name,
            fail_loads,
            engine=f"vLLM {vllm.__version__} scheduler",
            block_size=self.block_size,
            hosts=(host, loop.worker.host),
            kv_caches=loop.kv_caches,
            group_of_layer=loop.worker.context.group_of_layer(),
        )

    def _count(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        """The stats the data checks read: prompt tokens the connector set out to load, blocks it failed."""
        if outcome.exception is not None:
            return
        if call == "update_state_after_alloc":
            request, _, plan = args
            if outcome.result and plan.num_tokens:
                self.committed(request, plan)
        elif (out := args[0].get(self.name)) is not None:
            self.stats.failed_load_blocks += len(out.invalid_block_ids)
