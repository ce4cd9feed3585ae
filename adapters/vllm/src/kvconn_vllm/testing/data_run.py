"""What the data checks (KV040-KV049) read of a run through vLLM, beyond a scheduler driver's.

:class:`VllmDataRunDriver` is a :class:`~.scheduler_driver.VllmSchedulerDriver` whose loop is a
:class:`~.model_loop.ModelLoop` (a model that reads KV): it keeps the requests for their tokens, counts the loads
the connector committed, audits each load that lands, and holds the failures injected
(a :class:`~kvconn.testing.conformance.driver.DataDriver`). Read by the two data drivers (:mod:`.data_driver`,
:mod:`.native_data`), which say where the connector is watched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvconn.host import LoadPlan
from kvconn.reference.shape import EngineShape
from kvconn.reference.stats import EngineStats
from kvconn.testing.conformance.diagnose import Diagnosis, explain_wrong_kv
from kvconn.testing.conformance.driver import NO_KEYS, DriverSpec, RequestKeys, StepRecord
from kvconn.testing.conformance.fault_injection import LoadFailures
from kvconn.testing.conformance.loaded_kv import LoadedBlock

from .harness import make_request
from .model_loop import ModelLoop
from .scheduler_driver import StepObserver, VllmSchedulerDriver

__all__ = ["VllmDataRunDriver"]


class VllmDataRunDriver(VllmSchedulerDriver):
    """A :class:`~.scheduler_driver.VllmSchedulerDriver` the data checks run on (see the module docstring).

    Whoever watches the connector calls :meth:`committed` for each load it commits and adds its failed blocks to
    ``stats.failed_load_blocks``; ``failures`` is the run's
    :class:`~kvconn.testing.conformance.fault_injection.LoadFailures`, if any.
    """

    loop: ModelLoop

    def __init__(self, spec: DriverSpec, shape: EngineShape, loop: ModelLoop, observer: StepObserver) -> None:
        super().__init__(spec, shape, loop, observer)
        self.stats = EngineStats()
        self.failures: LoadFailures | None = None
        #: the layer-blocks of landed loads that held other KV than the model computes (:meth:`ModelLoop.audit`)
        self.wrong_loads: list[LoadedBlock] = []
        self._requests: dict[str, Any] = {}
        self._loaded: dict[str, int] = {}

    def committed(self, request: Any, plan: LoadPlan) -> None:
        """A load the connector committed: ``plan.num_tokens`` from ``request``'s computed tokens."""
        tokens = plan.num_tokens or 0
        self._loaded[request.request_id] = tokens
        start = request.num_computed_tokens
        first = start // self.block_size
        self.loop.expect_load(request.request_id, range(first, first + tokens // self.block_size))
        self.stats.prompt_tokens_loaded += max(0, min(start + tokens, len(request.prompt_token_ids)) - start)

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int, keys: RequestKeys = NO_KEYS) -> None:
        request = make_request(req_id, prompt, max_tokens, self.block_size, **keys._asdict())
        self.scheduler.add_request(request)
        self._requests[req_id] = request

    def step(self, *, withhold: Iterable[str] = ()) -> StepRecord:
        self._loaded = {}
        record = super().step(withhold=frozenset(withhold))
        record.loaded = self._loaded
        skip = set(getattr(self.loop.last_kv_output, "invalid_block_ids", None) or ())  # loads reported failed
        if self.failures is not None:  # the blocks it made fail this step hold its garbage, reported failed
            skip |= self.failures.failed_blocks
        self.wrong_loads += self.loop.audit(len(self.loop.outputs) - 1, skip)
        return record

    def explain_wrong_kv(self, records: Sequence[StepRecord]) -> Diagnosis | None:
        """Why the run's tokens went wrong, from what its loads landed (``None``: every load landed right KV)."""
        hashes = {req_id: request.block_hashes for req_id, request in self._requests.items()}
        return explain_wrong_kv(self.wrong_loads, self.loop.group_layers, records, hashes, {})

    def generated(self, req_id: str) -> list[int]:
        """The tokens ``req_id`` generated so far."""
        return list(self._requests[req_id].output_token_ids)

    @property
    def injected_failure(self) -> bool:
        """Whether a load was made to fail (``fail_loads``)."""
        return self.failures is not None and self.failures.failed > 0
