"""The convenience base class connectors derive from.

A connector class declares, as class attributes, everything an engine or the
CLI needs to know without running it: its ``Config`` and ``Metadata`` Structs,
the roles it serves, whether it saves and/or loads, and the SDK API version it
was written against. Its hook implementations (see :mod:`kvconn.hookspecs`)
are either its own methods named after hooks, or the methods of the side
objects it declares per role (``scheduler_side`` / ``worker_side``, below).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from ._plugins.sides import build_side
from .context import ConnectorContext
from .metadata import KVConnectorMetadata
from .telemetry import CacheTier, MetricSpec
from .version import API_VERSION

__all__ = ["KVConnector", "KVConnectorRole", "NoConfig"]


class KVConnectorRole(str, enum.Enum):
    """Which side of the engine a connector instance serves."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class NoConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Config of a connector that takes no options."""


class KVConnector:
    """Base class for connectors.

    Subclasses set the class attributes below and define hook methods, or
    declare a side per role whose methods are the hooks. The constructor
    stores ``config`` (an instance of ``Config``), ``role`` and ``context``,
    and builds ``side``. One instance serves one role.
    """

    #: msgspec Struct of the options; ``forbid_unknown_fields=True`` is advised. A ``renamed_fields``
    #: ClassVar on it (old name -> new name) makes a config that uses an old name fail with the new one.
    Config: ClassVar[type[msgspec.Struct]] = NoConfig
    #: msgspec Struct subclass returned by ``build_connector_meta``.
    Metadata: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    roles: ClassVar[frozenset[KVConnectorRole]] = frozenset(KVConnectorRole)
    saves: ClassVar[bool] = False
    loads: ClassVar[bool] = False
    #: ``"MAJOR.MINOR"`` of the kvconn hook API the connector was written for.
    api_version: ClassVar[str] = API_VERSION
    #: ``True`` when the scheduler-side and worker-side instances meet only through
    #: this process's memory (an in-process store), so they work only where the
    #: engine runs its scheduler and workers in one process. An engine whose
    #: workers run in other processes refuses such a connector at start-up, rather
    #: than run it with no hits. A property may decide it from the config.
    in_process_state: bool = False
    #: Where the connector's hits come from (:mod:`kvconn.telemetry`), so an engine can say which tier served
    #: each cached token; ``None``: not said (vLLM counts such hits as ``external_unspecified``).
    cache_tier: ClassVar[CacheTier | None] = None
    #: Metrics the connector reports in its stats beyond :data:`kvconn.telemetry.STANDARD_COUNTERS`
    #: (a pool's occupancy, say): declared here, exported by the engine adapter under the connector's name.
    metrics: ClassVar[tuple[MetricSpec, ...]] = ()
    #: The class whose instance implements the scheduler-side hooks, or its lazy
    #: ``"package.module:Class"`` path (imported only when that role is built);
    #: ``None``: this class's own methods are the scheduler-side hooks.
    scheduler_side: ClassVar[type | str | None] = None
    #: The same for the worker-side hooks (a path keeps torch out of the scheduler process).
    worker_side: ClassVar[type | str | None] = None

    def __init__(
        self,
        config: msgspec.Struct | None = None,
        *,
        role: KVConnectorRole,
        context: ConnectorContext | None = None,
    ) -> None:
        self.config = config if config is not None else type(self).Config()
        self.role = KVConnectorRole(role)
        self.context = context if context is not None else ConnectorContext()
        #: This role's side, built as ``Side(config, context)``: the object registered as the
        #: pluggy plugin in place of the connector. ``None`` when the connector is its own hooks.
        self.side: object | None = build_side(type(self), self.role.value, self.config, self.context)

    @classmethod
    def fresh_store_config(cls, run: str, directory: Path) -> Mapping[str, Any] | None:
        """Config fields giving one conformance run (``kvconn validate``, ``ConnectorConformance``) a store of its own.

        A store that outlives the connector's instances (files, a server, a
        process-wide dict) would carry one run's blocks into the next and into
        the next ``kvconn validate`` (KV045): override this to answer, for the
        run named ``run``, the fields that point the connector at an empty
        store (a fresh namespace; a database file under ``directory``, a
        directory the suite creates for this run and removes afterwards). They
        are laid over the config under test. ``None`` (the default): instances
        share nothing that outlives them.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role.value})"
