"""The scheduler checks' driver for vLLM's own connectors: vLLM's scheduler, the connector's own worker.

:class:`NativeDriver` is a :class:`~.scheduler_driver.VllmSchedulerDriver` whose observer is the connector's
observed class (:class:`~.native_observer.NativeObserver`) and whose worker side is the connector's own worker
(or its stand-in), run through vLLM's ``KVConnectorModelRunnerMixin`` on fake KV tensors
(:class:`~.harness.VllmLoop`). Built by :mod:`.native_session`'s factory.
"""

from __future__ import annotations

from kvconn.testing.conformance.driver import DriverSpec

from .harness import VllmLoop
from .native_observer import NativeObserver, native_engine
from .native_target import NativeTarget
from .scheduler_driver import VllmSchedulerDriver

__all__ = ["NativeDriver"]


class NativeDriver(VllmSchedulerDriver):
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over vLLM's scheduler for a vLLM connector."""

    def __init__(self, spec: DriverSpec, target: NativeTarget) -> None:
        observer = NativeObserver(target)
        shape, scheduler, make_worker = native_engine(spec, observer)
        observer.loop = VllmLoop(scheduler, make_worker=make_worker)
        super().__init__(spec, shape, observer.loop, observer)
