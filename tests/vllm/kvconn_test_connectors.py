"""Small kvconn connectors that exercise what the dummy does not: delayed frees and loads.

Loaded by ``"kvconn_test_connectors:HandoffConnector"`` (kvconn's
``module:Class`` form); the test adds this directory to ``sys.path``.
"""

from __future__ import annotations

import msgspec

import kvconn
from kvconn import BlockIds, ConnectorRequest, KVConnectorBlockState, KVConnectorMetadata, SchedulerOutput


class HandoffConfig(msgspec.Struct, forbid_unknown_fields=True):
    #: delay freeing every finished request until the worker reports it sent
    delay_free: bool = True
    #: the worker reports a finished request as sent this many steps after learning it finished
    send_steps: int = 1
    #: claim this many tokens (a synchronous load) for requests whose id starts with "hit"
    hit_tokens: int = 0
    #: the worker side raises in start_load_kv when it has loads
    fail_load: bool = False


class HandoffMetadata(KVConnectorMetadata):
    loads: dict[str, list[int]] = msgspec.field(default_factory=dict)


class HandoffConnector(kvconn.KVConnector):
    """Delays frees and (optionally) claims sync loads; counts what it was told."""

    Config = HandoffConfig
    Metadata = HandoffMetadata
    saves = True
    loads = True
    config: HandoffConfig

    def __init__(self, config: HandoffConfig | None = None, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        self.finished: list[str] = []
        self.pending_loads: dict[str, list[int]] = {}
        self.sending: dict[str, int] = {}
        self.outputs: list[kvconn.KVConnectorOutput] = []

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id.startswith("hit") and self.config.hit_tokens > num_computed_tokens:
            return self.config.hit_tokens - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: BlockIds, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            size = self.context.block_size
            first = request.num_computed_tokens // size
            self.pending_loads[request.request_id] = block_ids[0][first : first + num_external_tokens // size]

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> HandoffMetadata:
        loads, self.pending_loads = self.pending_loads, {}
        return HandoffMetadata(loads=loads)

    def request_finished(self, request: ConnectorRequest) -> bool:
        self.finished.append(request.request_id)
        return self.config.delay_free

    def update_connector_output(self, connector_output: kvconn.KVConnectorOutput) -> None:
        self.outputs.append(connector_output)

    # worker side
    def start_load_kv(self, metadata: HandoffMetadata) -> None:
        if metadata.loads and self.config.fail_load:
            raise OSError("store unreachable")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], None]:
        for req_id in finished_req_ids:
            self.sending[req_id] = self.config.send_steps
        done = set()
        for req_id in list(self.sending):
            self.sending[req_id] -= 1
            if self.sending[req_id] <= 0:
                del self.sending[req_id]
                done.add(req_id)
        return done, None


class SlowHandoffConnector(HandoffConnector):
    """The same under another name (a second connector in one host)."""


class SchedulerOnlyConnector(kvconn.KVConnector):
    """Serves the scheduler role only: it builds metadata no worker runs a connector for."""

    roles = frozenset({kvconn.KVConnectorRole.SCHEDULER})

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class TablesMetadata(KVConnectorMetadata):
    tables: dict[str, BlockIds] = msgspec.field(default_factory=dict)


class TablesConnector(kvconn.KVConnector):
    """Ships every offered request's whole table each step: what a test compares with vLLM's live tables.

    The eager pattern real connectors avoid (its cost grows with the blocks held); here it shows the tables.
    """

    Metadata = TablesMetadata

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> TablesMetadata:
        tables = {r: block_state.get_block_ids(r) for r in scheduler_output.num_scheduled_tokens}
        return TablesMetadata(tables={r: t for r, t in tables.items() if t is not None})


class FieldsMetadata(KVConnectorMetadata):
    cached_req_ids: list[str] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)


class FieldsConnector(kvconn.KVConnector):
    """Keeps scheduler-output fields in its metadata as they are handed out (under vLLM: read-only views)."""

    Metadata = FieldsMetadata

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FieldsMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        return FieldsMetadata(
            cached_req_ids=cached.req_ids,  # type: ignore[arg-type]
            num_computed_tokens=cached.num_computed_tokens,  # type: ignore[arg-type]
            num_scheduled_tokens=scheduler_output.num_scheduled_tokens,  # type: ignore[arg-type]
        )


class StepMetadata(KVConnectorMetadata):
    step: int  # required: there is no default metadata to stand for an idle step


class StepConnector(kvconn.KVConnector):
    """Sends each step's number; its workers record what they were sent (the adapter never sends it idle)."""

    Metadata = StepMetadata

    def __init__(self, config: msgspec.Struct | None = None, **kwargs: object) -> None:
        super().__init__(config, **kwargs)  # type: ignore[arg-type]
        self.steps: list[int] = []

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        return StepMetadata(step=scheduler_output.step)

    def start_load_kv(self, metadata: StepMetadata) -> None:
        self.steps.append(metadata.step)
