"""The ``vllm`` conformance driver: scenarios played through vLLM's real scheduler.

``run_conformance(name, driver="vllm")`` (and ``kvconn validate NAME --engine
vllm``) builds, per scenario, vLLM's v1 ``Scheduler`` on the CPU with the
connector loaded through :class:`KVConnVllmConnector`, plus a worker-side
adapter on fake KV caches (:class:`~.harness.VllmLoop`). Observation happens
at the adapter's ``ConnectorHost``, exactly where the reference driver
observes, so every scheduler-side check reads the same :class:`StepRecord`.

Importing this module does not import vLLM; :func:`load_driver` does, and
raises a one-line error when vLLM is missing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from kvconn.errors import ConnectorLoadError
from kvconn.host import CallOutcome
from kvconn.host.wire import decode_metadata
from kvconn.install import checkout_path
from kvconn.outputs import KVConnectorOutput
from kvconn.testing.conformance.driver import (
    DriverFactory,
    DriverSpec,
    StepRecord,
    observe_block_state,
    tracked_by_role,
)

from ..reports import decode_report
from .scheduler_driver import VllmSchedulerMethods

if TYPE_CHECKING:
    from .data_driver import VllmDataDriver
    from .harness import VllmLoop

__all__ = ["VllmDriver", "load_driver"]

#: Builds a venv with vLLM's scheduler (``scheduler``) or full CPU engine (``engine``), relative to the checkout.
_VENV_SCRIPT = "scripts/install-vllm-venv.sh"


def load_driver() -> DriverFactory:
    """The driver factory; :class:`ConnectorLoadError` when vLLM cannot be imported."""
    from .harness import prepare_environment, vllm_import_error

    prepare_environment()
    error = vllm_import_error()
    if error is not None:
        script = checkout_path(_VENV_SCRIPT) or f"{_VENV_SCRIPT} (in a kvconn checkout)"
        raise ConnectorLoadError(
            f"vLLM is not installed in this environment: {error} "
            f"(build a venv with it: {script} scheduler, then run kvconn from that venv)"
        )
    return VllmDriver


class VllmDriver(VllmSchedulerMethods):
    """A :class:`~kvconn.testing.conformance.SchedulerDriver` over vLLM's scheduler."""

    def __init__(self, spec: DriverSpec) -> None:
        from .harness import VLLM_TEST_SHAPE, check_ranks, make_scheduler

        check_ranks(spec.shape)
        self.block_size, self.num_blocks = spec.shape.block_size, spec.shape.num_blocks
        self.name = spec.connector
        # the scenario's shape, on the tiny model's KV shape; max_model_len: the tiny model's positions
        self.shape = spec.shape.replace(
            max_model_len=2048, num_kv_heads=VLLM_TEST_SHAPE.num_kv_heads, head_dim=VLLM_TEST_SHAPE.head_dim
        )
        self.scheduler = make_scheduler(spec.connector, spec.config, shape=self.shape)
        self.loop = self._loop(self.scheduler)
        self.adapter = self.scheduler.connector
        self.metadata_type = self.adapter.host.metadata_types[self.name]
        self._finished_calls: Counter[str] = Counter()
        self._withhold: frozenset[str] = frozenset()
        self._built = None
        self._resolved: list[str] = []
        self._observe()

    def _loop(self, scheduler: Any) -> VllmLoop:
        """The loop that runs the worker side of each step (a data driver's has a model)."""
        from .harness import VllmLoop

        return VllmLoop(scheduler)

    @staticmethod
    def data_driver(spec: DriverSpec, **options: Any) -> VllmDataDriver:
        """The data checks' driver: :class:`~.data_driver.VllmDataDriver` (``options``: its keywords)."""
        from .data_driver import VllmDataDriver

        return VllmDataDriver(spec, **options)

    def _observe(self) -> None:
        """Monitor the scheduler-side host, where the reference driver observes too."""
        self.adapter.host.add_monitor(self._before, self._after, calls=("build_connector_meta", "request_finished"))

    def _before(self, call: str, args: tuple[Any, ...]) -> None:
        if call == "build_connector_meta":
            self._resolved = []
            observe_block_state(args[1], self._withhold, self._resolved)
        else:
            self._finished_calls[args[0].request_id] += 1

    def _after(self, call: str, args: tuple[Any, ...], outcome: CallOutcome) -> None:
        if call == "build_connector_meta" and outcome.exception is None:
            output, block_state = args
            self._built = (output, outcome.result.get(self.name), frozenset(block_state.req_ids), self._resolved)

    # ---------------------------------------------------------------- protocol

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        (output, metadata, offered, resolved), preempted, tables = self._play_step(withhold)
        sent = self.loop.outputs[-1].kv_connector_metadata
        encoded = self.adapter.sent_metadata(sent, self.name) if metadata is not None else None
        types = {self.name: self.metadata_type}
        decoded = decode_metadata(self.name, encoded, types) if encoded is not None else None
        kv_output = self.loop.last_kv_output  # None after a step without a forward whose workers reported nothing
        worker_meta = kv_output.kv_connector_worker_meta if kv_output is not None else None
        reports = [decode_report(blob).outputs.get(self.name) for blob in worker_meta.reports] if worker_meta else []
        return StepRecord(
            output=output,
            metadata=metadata,
            decoded=decoded,
            encoded=encoded,
            tables=tables,
            offered=offered,
            resolved=resolved,
            connector_output=reports[0] if reports else KVConnectorOutput(),  # no report: the worker had no news
            preempted=preempted,
        )

    def num_tracked_requests(self) -> dict[str, int]:
        return tracked_by_role(self.name, self.adapter.host, self.loop.worker.host)

    def assert_empty(self) -> None:
        super().assert_empty()
        loads = {name: reqs for name, reqs in self.adapter.host.pending_loads().items() if reqs}
        assert not loads, f"loads still in flight: {loads}"

    def close(self) -> None:
        self.adapter.shutdown()
        self.loop.shutdown()
