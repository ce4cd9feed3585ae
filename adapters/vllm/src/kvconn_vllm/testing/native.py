"""The conformance suite for vLLM's own connectors (``KVConnectorBase_V1`` subclasses), through vLLM's scheduler.

``kvconn validate --engine vllm --vllm-connector NAME`` judges a connector
that is not a kvconn plugin: a name in vLLM's ``KVConnectorFactory``
(``ExampleConnector``, ``MooncakeStoreConnector``...) or
``"pkg.module:Class"`` (:mod:`.native_target`). :func:`run_native_conformance` plays the same
scenarios as every other driver through vLLM's real ``Scheduler`` (the
harness of :mod:`.harness`), the connector configured as vLLM configures it
(``kv_connector`` + ``kv_connector_module_path``, the config as its
``kv_connector_extra_config``), and runs the checks that apply to a vLLM
connector (:mod:`.native_session`).

Seams, none of them in vLLM's scheduler or model runner:

* **the connector.** vLLM builds, from its config, a subclass made in :mod:`.native_observer` that records what
  its scheduler-side calls saw.
* **the worker.** The connector's own worker runs through vLLM's
  ``KVConnectorModelRunnerMixin`` on fake KV tensors (:class:`.harness.VllmLoop`).
  A worker that cannot run without CUDA is replaced by a stand-in (:mod:`.stand_ins`), and the report says so.
* **the wire.** Metadata crosses as vLLM's ``MessageQueue`` sends it, with
  ``pickle``; :mod:`.wire` reports the scheduler-side objects found in it (the seed's serialization concern).

:func:`run_native_conformance` is what the CLI calls (``kvconn_cli``'s ``validate`` imports it by this path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvconn.testing.conformance import ConnectorReport, run_session
from kvconn.testing.conformance.results import CheckResult

from .harness import require_vllm
from .native_session import NativeSession
from .native_target import native_target

__all__ = ["run_native_conformance"]


def run_native_conformance(
    name: str,
    *,
    config: Mapping[str, Any] | None = None,
    select: str | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> ConnectorReport:
    """Every check that applies to the vLLM connector ``name``, through vLLM's scheduler; never raises."""
    try:
        require_vllm()
        target = native_target(name)
    except Exception as exc:
        return ConnectorReport(name, [], load_error=str(exc))
    session = NativeSession(target, config)
    report = run_session(session, select=select, on_result=on_result)
    if session.stand_in is not None:
        report.notes.append(session.stand_in.note())
    return report
