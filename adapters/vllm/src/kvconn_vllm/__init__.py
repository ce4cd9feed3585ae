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

Who reads it: vLLM (``kv_connector_module_path="kvconn_vllm"``, the entry point), operators' configs (the names
below), ``kvconn.adapters.vllm`` (an alias of this package), and the CLI and kvconn's conformance runner (through
:mod:`.testing`). Public names: ``__all__`` below, and :mod:`.connector`'s (the class keeps that import path).

Its modules, each importing only those below it (import-linter's ``layers`` contract in pyproject.toml):

* :mod:`.testing`: the test rig, which drives the adapter through vLLM's scheduler; nothing vLLM runs when it serves;
* :mod:`.connector`: ``KVConnVllmConnector``, the thin ``KVConnectorBase_V1`` shell vLLM loads;
* :mod:`.scheduler` | :mod:`.worker` | :mod:`.config`: the scheduler side and the worker side the shell delegates to,
  and the config both read (``kv_connector_extra_config``, the host built from it);
* :mod:`.metadata` | :mod:`.reports` | :mod:`.tables`: what crosses processes, the workers' reports, the table
  tracker for a vLLM without the lazy block state;
* :mod:`.telemetry` | :mod:`.translate` | :mod:`.compat` | :mod:`.registration`: stats and metrics, vLLM's types as
  kvconn's, what this vLLM offers, and the names vLLM's config uses.

A change here must update: docs/vllm.md (what operators configure and read), the contract in pyproject.toml for a
new module, and the vLLM tiers' tests (``tests/vllm``, ``tests/vllm_029``); a change on the step path, the before/after
figures of ``benchmarks/vllm_step_before_after.py``.
"""

from __future__ import annotations

from typing import Any

from .registration import CONNECTOR_CLASS, EXTRA_CONFIG_KEYS, SHORT_NAME, route_logs_to_vllm

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

_LAZY = {"KVConnVllmConnector", "KVConnVllmMetadata", "KVConnVllmStats", "KVConnVllmWorkerMetadata"}


def register() -> None:
    """Register ``"kvconn"`` with vLLM's ``KVConnectorFactory`` unless already there."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    route_logs_to_vllm()
    if SHORT_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SHORT_NAME, __name__, CONNECTOR_CLASS)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
