"""kvconn: an SDK for KV-cache connectors.

Connector authors implement the hooks of :mod:`kvconn.hookspecs` on a
:class:`KVConnector` subclass, or on one class per role that it declares as its
``scheduler_side`` / ``worker_side``, and declare it in the ``kvconn.connectors``
entry-point group. Engines load connectors by name with :func:`load_connector`
and drive them through a :class:`ConnectorHost`. Importing kvconn does not
import torch.

Read by: connector authors, engines and adapters, the CLI. Public: ``__all__``
below and the subpackages (:mod:`kvconn.store`, :mod:`kvconn.host`,
:mod:`kvconn.reference`, :mod:`kvconn.testing`), each saying in its docstring
who reads it. The modules sit in layers (the ``kvconn`` contract in
``pyproject.toml``, drawn in docs/architecture.md): the test kit over the
reference engine, over the host, the store and introspection, over the plugin
registry, over the author API (:mod:`.connector`, whose sides
:mod:`._plugins.sides` builds, and :mod:`.hookspecs`), over the plain types. A
change to a public name updates DESIGN.md's contract and docs/architecture.md.
"""

from __future__ import annotations

from ._plugins.markers import hookimpl, hookspec
from ._plugins.registry import ConnectorEntry, available_connectors, load_connector, load_connector_class
from .block_state import BlockIds, KVConnectorBlockState, block_ids_in_range
from .connector import KVConnector, KVConnectorRole, NoConfig
from .context import DEFAULT_KV_CACHE_GROUPS, NULL_BLOCK_ID, ConnectorContext, KVCacheGroupSpec
from .cursor import SaveCursor
from .errors import (
    BlockStateSerializationError,
    ConnectorConfigError,
    ConnectorError,
    ConnectorLoadError,
    ConnectorNotFoundError,
    HookOverBudget,
    KVConnError,
    WireError,
)
from .filled import FilledBlocks, filled_blocks, iter_block_ids
from .host import ConnectorHost, LoadPlan, StepUpdate
from .metadata import KVConnectorMetadata
from .outputs import CachedRequestData, KVConnectorOutput, ModelRunnerOutput, NewRequestData, SchedulerOutput
from .request import ConnectorRequest
from .version import API_VERSION
from .window import loadable_hit, window_blocks

__version__ = "0.1.0"

__all__ = [
    "API_VERSION",
    "DEFAULT_KV_CACHE_GROUPS",
    "NULL_BLOCK_ID",
    "BlockIds",
    "BlockStateSerializationError",
    "CachedRequestData",
    "ConnectorConfigError",
    "ConnectorContext",
    "ConnectorEntry",
    "ConnectorError",
    "ConnectorHost",
    "ConnectorLoadError",
    "ConnectorNotFoundError",
    "ConnectorRequest",
    "FilledBlocks",
    "HookOverBudget",
    "KVCacheGroupSpec",
    "KVConnError",
    "KVConnector",
    "KVConnectorBlockState",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "LoadPlan",
    "ModelRunnerOutput",
    "NewRequestData",
    "NoConfig",
    "SaveCursor",
    "SchedulerOutput",
    "StepUpdate",
    "WireError",
    "available_connectors",
    "block_ids_in_range",
    "filled_blocks",
    "hookimpl",
    "hookspec",
    "iter_block_ids",
    "load_connector",
    "load_connector_class",
    "loadable_hit",
    "window_blocks",
]
