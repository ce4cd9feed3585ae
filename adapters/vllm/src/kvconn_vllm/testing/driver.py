"""The ``vllm`` conformance driver: scenarios played through vLLM's real scheduler.

``run_conformance(name, driver="vllm")`` (and ``kvconn validate NAME --engine
vllm``) builds, per scenario, vLLM's v1 ``Scheduler`` on the CPU with the
connector loaded through :class:`~kvconn_vllm.connector.KVConnVllmConnector`, plus a worker-side
adapter on fake KV caches (:class:`~.harness.VllmLoop`). Observation happens
at the adapter's ``ConnectorHost`` (:class:`~.host_observer.HostObserver`),
exactly where the reference driver observes, so every scheduler-side check
reads the same :class:`~kvconn.testing.conformance.driver.StepRecord`. Its
``data_driver`` is :class:`~.data_driver.VllmDataDriver`.

Importing this module does not import vLLM; :func:`load_driver` (the ``vllm``
entry point of ``kvconn.conformance_drivers``) does, and raises a one-line
error when vLLM is missing.
"""

from __future__ import annotations

from typing import Any

from kvconn.testing.conformance.driver import DriverFactory, DriverSpec
from kvconn.testing.conformance.waits import wait_seconds

from .data_driver import VllmDataDriver
from .harness import VllmLoop, make_scheduler, require_vllm
from .host_observer import HostObserver
from .scheduler_driver import VllmSchedulerDriver, vllm_shape

__all__ = ["VllmDriver", "load_driver"]


def load_driver() -> DriverFactory:
    """The driver factory; :class:`~kvconn.errors.ConnectorLoadError` when vLLM cannot be imported."""
    require_vllm()
    return VllmDriver


class VllmDriver(VllmSchedulerDriver):
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over vLLM's scheduler for a kvconn plugin."""

    def __init__(self, spec: DriverSpec) -> None:
        shape = vllm_shape(spec.shape)
        scheduler = make_scheduler(spec.connector, spec.config, shape=shape, stall_s=wait_seconds())
        super().__init__(spec, shape, VllmLoop(scheduler), HostObserver(spec.connector, scheduler.connector))

    @staticmethod
    def data_driver(spec: DriverSpec, **options: Any) -> VllmDataDriver:
        """The data checks' driver: :class:`~.data_driver.VllmDataDriver` (``options``: its keywords)."""
        return VllmDataDriver(spec, **options)
