"""The scheduler driver protocol: how checks drive a connector through an engine.

Scheduler-side checks never touch an engine directly. They play scripted
scenarios through a :class:`SchedulerDriver` and analyse the
:class:`StepRecord` each step returns, so another engine (vLLM's scheduler,
say) is supported by registering one more driver (:mod:`.driver_registry`), without touching a
check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ...block_state import BlockIds, KVConnectorBlockState
from ...host import ConnectorHost
from ...metadata import KVConnectorMetadata
from ...outputs import KVConnectorOutput, SchedulerOutput
from ...reference.shape import EngineShape
from ...reference.stats import EngineStats

__all__ = [
    "ScenarioUnsupported",
    "DataDriver",
    "DriverFactory",
    "DriverSpec",
    "SchedulerDriver",
    "StepRecord",
    "HandedTable",
    "NO_KEYS",
    "RequestKeys",
    "freeze",
    "mutated_tables",
    "observe_block_state",
    "tracked_by_role",
]


@dataclass(frozen=True)
class DriverSpec:
    """What a scenario asks of the engine a driver builds.

    ``connector`` is an installed name or ``"pkg.mod:Class"``; errors raised
    by the connector must surface (``on_error="raise"``), not be degraded.
    ``shape`` sizes the engine (a small ``num_blocks`` forces preemption);
    a driver whose engine cannot take it raises :class:`ScenarioUnsupported`.
    """

    connector: str
    config: Mapping[str, Any] | None = None
    shape: EngineShape = field(default_factory=EngineShape)


@dataclass
class StepRecord:
    """What one step showed.

    Attributes:
        output: the step's scheduler output (scheduler-side object).
        metadata: this connector's metadata as built (``None`` if it built none).
        decoded: the same metadata after the wire (encode, decode) as a worker got it.
        encoded: its encoded bytes.
        tables: the live table, at this step, of every request holding blocks
            (scheduled ones, and finished ones whose blocks are held).
        offered: the requests the block state offered.
        resolved: request ids the connector's block-state resolver was called
            for, in call order.
        connector_output: what this connector's worker side reported for the
            step, or ``None`` when the driver does not run its worker side.
        preempted: requests preempted while scheduling this step.
        mutated: tables the connector changed after they were handed to it
            (a driver that does not look leaves it empty).
        unexpected_reports: ids the worker reported in ``finished_sending`` /
            ``finished_recving`` that the engine was not waiting for (a
            driver that does not track it leaves it empty).
        loaded: tokens the connector set out to load this step, per request
            (a driver that does not track it leaves it empty).
    """

    output: SchedulerOutput
    metadata: KVConnectorMetadata | None
    decoded: KVConnectorMetadata | None
    encoded: bytes | None
    tables: dict[str, BlockIds]
    offered: frozenset[str]
    resolved: list[str]
    connector_output: KVConnectorOutput | None = None
    preempted: set[str] = field(default_factory=set)
    mutated: list[str] = field(default_factory=list)
    unexpected_reports: list[str] = field(default_factory=list)
    loaded: dict[str, int] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return self.output.step


class RequestKeys(NamedTuple):
    """What a request adds to its block hashes as vLLM's extra keys (:func:`kvconn.hashing.block_extra_keys`).

    ``adapter``: the LoRA adapter it runs under (its KV differs); ``cache_salt``: its tenant (its cached
    prefixes are its own).
    """

    adapter: str | None = None
    cache_salt: str | None = None


#: A request with no adapter and no tenant.
NO_KEYS = RequestKeys()


class SchedulerDriver(Protocol):
    """One engine with the connector under test loaded (see the package docstring)."""

    block_size: int
    num_blocks: int

    def add_request(self, req_id: str, prompt: Sequence[int], max_tokens: int, keys: RequestKeys = NO_KEYS) -> None:
        """Queue a request (it is scheduled on a later ``step``); ``keys``: its adapter and tenant."""

    def abort(self, req_id: str) -> None:
        """Abort a request, waiting or running; the connector's ``request_finished`` follows."""

    def step(self, *, withhold: Collection[str] = ()) -> StepRecord:
        """Run one step. Requests in ``withhold`` are left out of the offered block state."""

    def has_unfinished(self) -> bool:
        """Requests not finished yet."""

    def has_work(self) -> bool:
        """Unfinished requests, or finished ones whose blocks a connector still holds."""

    def finished_calls(self) -> dict[str, int]:
        """How many times the connector's ``request_finished`` ran, per request id."""

    def num_tracked_requests(self) -> dict[str, int]:
        """Per role (``"scheduler"``, ``"worker"``), what the connector says it tracks."""

    def assert_empty(self) -> None:
        """Raise ``AssertionError`` naming what leaked if anything is left (blocks, requests)."""

    def close(self) -> None:
        """Shut the connector down and release the engine."""


DriverFactory = Callable[[DriverSpec], SchedulerDriver]


class DataDriver(SchedulerDriver, Protocol):
    """What the data checks (KV040-KV049) run on: an engine with the connector's worker side and a model.

    Built as ``factory.data_driver(spec, fail_loads=None, scrub_freed=False,
    worker_config=None)`` by a driver factory that has one (the reference
    driver's is :class:`~.reference.ReferenceDriver` itself): ``fail_loads``
    injects failed loads (:mod:`.fault_injection`), ``scrub_freed`` overwrites every
    block once it is freed, ``worker_config`` configures the worker side
    alone. Its model writes the reference model's KV and samples from the KV
    it reads, so its tokens are those of the reference engine with the same
    ``shape``.
    """

    #: the engine shape the model runs with (its KV shape decides the tokens)
    shape: EngineShape

    def generated(self, req_id: str) -> list[int]:
        """The tokens ``req_id`` generated so far."""

    @property
    def stats(self) -> EngineStats:
        """At least ``prompt_tokens_loaded`` and ``failed_load_blocks``."""

    @property
    def injected_failure(self) -> bool:
        """Whether a load was made to fail."""


def observe_block_state(
    block_state: KVConnectorBlockState,
    withhold: Collection[str],
    resolved: list[str],
    handed: list[HandedTable] | None = None,
) -> None:
    """Make ``block_state`` what a driver offers: less ``withhold``, each resolver call appended to ``resolved``.

    Changed in place, from a monitor run before the host's
    ``build_connector_meta`` (the scheduler builds a fresh block state for
    each step's call); its ``req_ids`` are then the step's
    :attr:`StepRecord.offered`. The recording resolver keeps the wrapped
    one's name, so metadata that holds it is reported as holding, e.g.,
    ``KVCacheManager.get_block_ids``. With ``handed``, every table it returns
    is recorded with a snapshot, for :func:`mutated_tables` to compare once
    the hook returned.
    """
    block_state.req_ids = set(block_state.req_ids) - set(withhold)
    block_state.resolve_block_ids = _RecordingResolver(block_state.resolve_block_ids, resolved, handed)


class _RecordingResolver:
    """A resolver that records each call; it pickles as the resolver it wraps (metadata holding it is caught as
    holding that one, e.g. vLLM's ``KVCacheManager.get_block_ids``)."""

    def __init__(
        self, resolve: Callable[[str], BlockIds], resolved: list[str], handed: list[HandedTable] | None
    ) -> None:
        functools.update_wrapper(self, resolve)
        self._resolve, self._resolved, self._handed = resolve, resolved, handed

    def __call__(self, req_id: str) -> BlockIds:
        self._resolved.append(req_id)
        table = self._resolve(req_id)
        if self._handed is not None:
            self._handed.append((f"the table get_block_ids({req_id!r}) returned", table, freeze(table)))
        return table

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._resolve.__reduce_ex__(protocol)


#: (where the table was handed to the connector, the table, a snapshot taken then)
HandedTable = tuple[str, BlockIds, tuple[tuple[int, ...], ...]]


def freeze(table: BlockIds) -> tuple[tuple[int, ...], ...]:
    """A snapshot of ``table`` that later mutation of the table cannot change."""
    return tuple(tuple(group) for group in table)


def mutated_tables(handed: Sequence[HandedTable]) -> list[str]:
    """Where a connector changed a table it was handed, e.g. ``"the table get_block_ids('r0') returned: ..."``."""
    return [
        f"{where}: {list(snapshot)} became {list(freeze(table))}"
        for where, table, snapshot in handed
        if freeze(table) != snapshot
    ]


def tracked_by_role(name: str, scheduler: ConnectorHost | None, worker: ConnectorHost | None) -> dict[str, int]:
    """:meth:`SchedulerDriver.num_tracked_requests` read from the hosts of each role (``None``: role not run)."""
    tracked: dict[str, int] = {}
    for role, host in (("scheduler", scheduler), ("worker", worker)):
        counts = host.num_tracked_requests() if host is not None else {}
        if name in counts:
            tracked[role] = counts[name]
    return tracked


class ScenarioUnsupported(Exception):
    """Raised by a driver factory for a scenario its engine cannot run (checks using it are skipped)."""
