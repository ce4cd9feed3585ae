"""kvconn connectors inside vLLM (v1 KV-connector API).

vLLM imports this module in every process that builds or reads its config
(front end, engine core, each worker, the metrics logger), so importing it is
cheap and has no side effect: it imports vLLM only when an attribute that
needs vLLM is read. ``getattr(module, "KVConnVllmConnector")``, which is what
vLLM's ``KVConnectorFactory`` does, imports :mod:`.connector`.

:func:`register` is the ``vllm.general_plugins`` entry point: it registers the
connector under the short name ``"kvconn"`` (idempotent; vLLM calls plugins
once per process, but several entry paths may call it), and sends kvconn's log
records through vLLM's logging configuration (:func:`route_logs_to_vllm`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

__all__ = [
    "CONNECTOR_CLASS",
    "EXTRA_CONFIG_KEYS",
    "SHORT_NAME",
    "KVConnVllmConnector",
    "KVConnVllmMetadata",
    "KVConnVllmStats",
    "KVConnVllmWorkerMetadata",
    "register",
    "route_logs_to_vllm",
]

#: The name under which :func:`register` makes the connector known to vLLM.
SHORT_NAME = "kvconn"
#: The class vLLM loads (``kv_connector`` when ``kv_connector_module_path`` is this module).
CONNECTOR_CLASS = "KVConnVllmConnector"
#: The keys of ``kv_connector_extra_config`` the adapter reads: the connector(s), their config, the host's options.
EXTRA_CONFIG_KEYS = (
    "kvconn_connector",
    "kvconn_config",
    "kvconn_on_error",
    "kvconn_stall_steps",
    "kvconn_hook_budget_s",
    "kvconn_max_slow_calls",
)

_LAZY = {"KVConnVllmConnector", "KVConnVllmMetadata", "KVConnVllmStats", "KVConnVllmWorkerMetadata"}


def register() -> None:
    """Register ``"kvconn"`` with vLLM's ``KVConnectorFactory`` unless already there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    route_logs_to_vllm()
    if SHORT_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SHORT_NAME, __name__, CONNECTOR_CLASS)


def route_logs_to_vllm(names: Iterable[str] = ()) -> None:
    """Send the ``kvconn`` logger's records, and those of ``names``, to vLLM's handlers at vLLM's level.

    kvconn and its plugins log under their package names, outside vLLM's
    ``vllm`` logger; with no handler they reach only Python's last-resort
    handler (warnings and up, bare text), so their INFO lines never show under
    vLLM. A logger that already has handlers was configured by the operator
    and is left alone; so is everything when vLLM's logging is not configured.
    """
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logging.getLogger().handlers:
        return  # vLLM's logging is off, or the process configured logging itself: records reach the root
    for name in ("kvconn", *names):
        target = logging.getLogger(name)
        if target.handlers:
            continue
        for handler in vllm_logger.handlers:
            target.addHandler(handler)
        target.setLevel(vllm_logger.level)
        target.propagate = False


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
