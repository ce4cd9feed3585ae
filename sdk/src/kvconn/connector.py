"""The convenience base class connectors derive from.

A connector class declares, as class attributes, everything an engine or the
CLI needs to know without running it: its ``Config`` and ``Metadata`` Structs,
the roles it serves, whether it saves and/or loads, and the SDK API version it
was written against. Methods named after hooks (see :mod:`kvconn.hookspecs`)
are its hook implementations.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

from .context import ConnectorContext
from .metadata import KVConnectorMetadata
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

    Subclasses set the class attributes below and define hook methods; the
    constructor stores ``config`` (an instance of ``Config``), ``role`` and
    ``context``. One instance serves one role.
    """

    #: msgspec Struct of the options; ``forbid_unknown_fields=True`` is advised.
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

    def __init__(
        self,
        config: msgspec.Struct | None = None,
        *,
        role: KVConnectorRole,
        context: ConnectorContext | None = None,
    ) -> None:
        self.config = config if config is not None else type(self).Config()
        self.role = role
        self.context = context if context is not None else ConnectorContext()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role.value})"
