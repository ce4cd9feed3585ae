"""kvconn connectors inside vLLM (v1 KV-connector API).

vLLM imports this module in every process that builds or reads its config
(front end, engine core, each worker, the metrics logger), so importing it is
cheap and has no side effect: it imports vLLM only when an attribute that
needs vLLM is read. ``getattr(module, "KVConnVllmConnector")``, which is what
vLLM's ``KVConnectorFactory`` does, imports :mod:`.connector`.

:func:`register` is the ``vllm.general_plugins`` entry point: it registers the
connector under the short name ``"kvconn"`` (idempotent; vLLM calls plugins
once per process, but several entry paths may call it).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CONNECTOR_CLASS",
    "SHORT_NAME",
    "KVConnVllmConnector",
    "KVConnVllmMetadata",
    "KVConnVllmStats",
    "KVConnVllmWorkerMetadata",
    "register",
]

#: The name under which :func:`register` makes the connector known to vLLM.
SHORT_NAME = "kvconn"
#: The class vLLM loads (``kv_connector`` when ``kv_connector_module_path`` is this module).
CONNECTOR_CLASS = "KVConnVllmConnector"

_LAZY = {"KVConnVllmConnector", "KVConnVllmMetadata", "KVConnVllmStats", "KVConnVllmWorkerMetadata"}


def register() -> None:
    """Register ``"kvconn"`` with vLLM's ``KVConnectorFactory`` unless already there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if SHORT_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SHORT_NAME, __name__, CONNECTOR_CLASS)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
