"""What kvconn's connectors declare (:mod:`kvconn.telemetry`), as vLLM's operators see it.

* Stats: :class:`KVConnVllmStats` carries each connector's counters as
  ``"<connector>.<counter>"`` (summed over workers and steps), its gauges under
  :data:`GAUGES` (the latest value wins) and the seconds of each step's loads and
  saves under :data:`SECONDS` (a list of observations).
* Prometheus: :class:`KVConnVllmPromMetrics` (what ``build_prom_metrics`` returns)
  turns those stats into ``vllm:kvconn_*`` series with vLLM's ``model_name`` and
  ``engine`` labels plus ``connector``. It runs in vLLM's front end, off the
  engine's step path, on the stats vLLM already ships there.
* The tier of a hit (:func:`hit_source`) and KV-cache events (:func:`to_vllm_events`).
* :class:`StepStats`: what one role of the adapter gathers between vLLM's asks, in that layout.

vLLM is imported only by the functions and class that need it (the module is
imported by the connector's two sides and :mod:`.metadata`, which vLLM imports
only once it runs a connector).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvconn import load_connector_class
from kvconn.errors import KVConnError
from kvconn.telemetry import DEGRADED_PREFIX, STANDARD_COUNTERS, TIER_MEDIUM, BlockStored, KVEvent, MetricSpec

if TYPE_CHECKING:
    from kvconn.host import ConnectorHost

__all__ = [
    "GAUGES",
    "SECONDS",
    "ConnectorTelemetry",
    "StepStats",
    "aggregate_stats",
    "hit_source",
    "prom_metrics_class",
    "reduce_stats",
    "to_vllm_events",
]

logger = logging.getLogger("kvconn.vllm")

#: The stats key holding ``{"<connector>.<gauge>": value}``: levels, never summed.
GAUGES = "gauges"
#: The stats key holding ``{"<connector>.load" | "<connector>.save": [seconds, ...]}``: one per step with work.
SECONDS = "seconds"

#: kvconn tiers as vLLM's ``CacheHitSource`` values. A remote store is vLLM's ``external_unspecified``, which
#: vLLM's own docs give as the source of "uninstrumented connector or remote store" (it has no remote member).
_TIER_SOURCE = {"host": "host", "disk": "disk", "p2p": "p2p", "remote": "external_unspecified"}

#: Seconds of one step's loads or saves: from a copy of a few blocks to a stalled remote store.
_STEP_SECONDS_BUCKETS = [1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]

_PROM_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


@dataclass(frozen=True)
class ConnectorTelemetry:
    """One hosted connector's declarations: its tier and the kinds of the metrics it adds."""

    tier: str | None
    gauges: frozenset[str]
    metrics: tuple[MetricSpec, ...]

    @classmethod
    def of(cls, connector_class: type) -> ConnectorTelemetry:
        metrics = tuple(getattr(connector_class, "metrics", ()) or ())
        gauges = frozenset(m.name for m in metrics if m.kind == "gauge")
        return cls(getattr(connector_class, "cache_tier", None), gauges, metrics)


class StepStats:
    """The stats one role of the adapter gathered since vLLM last asked, in :class:`KVConnVllmStats`' layout.

    vLLM asks both roles every step (``get_kv_connector_stats``), so :meth:`take` costs a test or two on a step
    where nothing happened. The host's degraded calls are counted in there, as ``<connector>.degraded.<hook>_error``.
    """

    def __init__(self, host: ConnectorHost) -> None:
        self.data: dict[str, Any] = {}
        self._host = host
        self._errors_seen: dict[tuple[str, str], int] = {}

    def add(self, key: str, value: float) -> None:
        """Add to a counter (a zero is not recorded)."""
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def add_reported(self, name: str, reported: Mapping[str, Any], gauges: frozenset[str], *, private: bool) -> None:
        """Connector ``name``'s reported stats: its ``gauges`` as levels, the rest as counters.

        ``private``: ``_`` keys are counted too (else they are left out: a worker's private gauges reach the
        connector's scheduler side only).
        """
        for key, value in reported.items():
            if key in gauges:
                self.data.setdefault(GAUGES, {})[f"{name}.{key}"] = value
            elif private or not key.startswith("_"):
                self.add(f"{name}.{key}", value)

    def observe_seconds(self, names: Iterable[str], what: str, seconds: float) -> None:
        """One step's seconds in loads or saves (``what``), for each connector with work in it."""
        observed = self.data.setdefault(SECONDS, {})
        for name in names:
            observed.setdefault(f"{name}.{what}", []).append(seconds)

    def take(self) -> dict[str, Any] | None:
        """What was gathered since the last call, and the host's new degraded calls; ``None`` when nothing."""
        if self._host.error_counts:
            for (name, hook), count in self._host.error_counts.items():
                if (new := count - self._errors_seen.get((name, hook), 0)) > 0:
                    self._errors_seen[(name, hook)] = count
                    self.add(f"{name}.degraded.{hook}_error", new)
        if not self.data:
            return None
        data, self.data = self.data, {}
        return data


def hit_source(tier: str | None) -> str:
    """vLLM's ``CacheHitSource`` value for hits from a connector of ``tier`` (undeclared: unspecified)."""
    return _TIER_SOURCE.get(tier or "", "external_unspecified")


def aggregate_stats(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """``into`` with ``other`` added: counters summed, gauges replaced, seconds appended (``into`` is changed)."""
    for key, value in other.items():
        if key == GAUGES:
            into[GAUGES] = {**into.get(GAUGES, {}), **value}
        elif key == SECONDS:
            seconds = {k: list(v) for k, v in into.get(SECONDS, {}).items()}
            for name, observed in value.items():
                seconds.setdefault(name, []).extend(observed)
            into[SECONDS] = seconds
        else:
            into[key] = into.get(key, 0) + value
    return into


def reduce_stats(data: Mapping[str, Any]) -> dict[str, int | float]:
    """The counters, for vLLM's ``KV Transfer metrics`` log line (levels and step times go to Prometheus only).

    Whoever adds the log lines up (``examples/vllm_offline.py``) gets totals: a level summed would mean nothing.
    """
    return {k: v for k, v in data.items() if k not in (GAUGES, SECONDS)}


def to_vllm_events(events: Iterable[KVEvent], tier: str | None) -> list[Any]:
    """kvconn's block events as vLLM's ``BlockStored`` / ``BlockRemoved``, with the tier's medium.

    Hashes go out as vLLM's KV-cache manager publishes its own
    (``maybe_convert_block_hash``: bytes, or 64-bit ints under
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so a router matches them with the
    blocks it saw stored on the device.
    """
    from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    medium = TIER_MEDIUM.get(tier or "", "STORAGE")
    converted: list[Any] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]
        if isinstance(event, BlockStored):
            fields: dict[str, Any] = {
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": event.block_size,
                "lora_id": None,
            }
            converted.append(_vllm_event(VllmBlockStored, hashes, medium, lora_name=None, **fields))
        else:
            converted.append(_vllm_event(VllmBlockRemoved, hashes, medium))
    return converted


def _vllm_event(event_type: type, hashes: list[Any], medium: str, **fields: Any) -> Any:
    """One of vLLM's event Structs, given only the fields this vLLM's has (``medium`` and ``lora_name`` are new)."""
    known = set(event_type.__struct_fields__)  # type: ignore[attr-defined]
    given = {"block_hashes": hashes, "medium": medium, **fields}
    return event_type(**{k: v for k, v in given.items() if k in known})


def _declarations(names: Sequence[str]) -> dict[str, ConnectorTelemetry]:
    """Each connector's declarations, from its class (no instance: this runs in vLLM's front end)."""
    found: dict[str, ConnectorTelemetry] = {}
    for name in names:
        try:
            found[name] = ConnectorTelemetry.of(load_connector_class(name))
        except KVConnError as exc:  # the engine refuses it with this error; its series just go without
            logger.warning("kvconn connector %r: no declared metrics exported: %s", name, exc)
            found[name] = ConnectorTelemetry(None, frozenset(), ())
    return found


def prom_metrics_class() -> type:
    """The :class:`KVConnVllmPromMetrics` class, built on vLLM's ``KVConnectorPromMetrics`` (imported here)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    class KVConnVllmPromMetrics(KVConnectorPromMetrics):
        """``vllm:kvconn_*`` series per connector, fed from the stats vLLM ships to its front end each step.

        Standard counters (:data:`kvconn.telemetry.STANDARD_COUNTERS`) as
        ``vllm:kvconn_<name>_total``, degraded events as
        ``vllm:kvconn_degraded_events_total{reason=...}``, the seconds of each
        step's loads and saves as histograms, and each connector's declared
        metrics (:attr:`kvconn.KVConnector.metrics`) as ``vllm:kvconn_<name>``.
        Keys that nothing declares stay in vLLM's log line only.
        """

        def __init__(
            self,
            vllm_config: Any,
            metric_types: dict[type, type],
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            named = (vllm_config.kv_transfer_config.kv_connector_extra_config or {}).get("kvconn_connector") or []
            names = [named] if isinstance(named, str) else [str(n) for n in named]
            self._names = sorted(names, key=len, reverse=True)  # a longer name first: "a.b" before "a"
            labels = [*labelnames, "connector"]
            # By kind: vLLM may hand other classes than prometheus_client's (its Ray wrappers).
            self._counters: dict[str, Any] = {}
            self._gauges: dict[str, Any] = {}
            for metric, documentation in STANDARD_COUNTERS.items():
                self._counters[metric] = self._counter_cls(
                    name=f"vllm:kvconn_{metric}", documentation=documentation, labelnames=labels
                )
            self._degraded = self._counter_cls(
                name="vllm:kvconn_degraded_events",
                documentation="Degraded events of the connector (no save, or a recompute), by reason",
                labelnames=[*labels, "reason"],
            )
            self._seconds = {
                what: self._histogram_cls(
                    name=f"vllm:kvconn_{what}_seconds",
                    documentation=f"Seconds the engine's step spent in the connector's {what}s, per step with {what}s",
                    buckets=_STEP_SECONDS_BUCKETS,
                    labelnames=labels,
                )
                for what in ("load", "save")
            }
            for name, declared in _declarations(names).items():
                for spec in declared.metrics:
                    self._declare(name, spec, labels)
            self._children: dict[tuple[Any, ...], Any] = {}
            self._split_cache: dict[str, tuple[str, str] | None] = {}

        def _declare(self, connector: str, spec: MetricSpec, labels: list[str]) -> None:
            known = spec.name in self._counters or spec.name in self._gauges
            if known or not _PROM_NAME.match(spec.name):
                if not known:
                    logger.warning("kvconn connector %r: metric %r is not a Prometheus name", connector, spec.name)
                return  # a standard counter, or declared by another connector already: one series per name
            if spec.kind == "gauge":
                self._gauges[spec.name] = self._gauge_cls(
                    name=f"vllm:kvconn_{spec.name}",
                    documentation=spec.documentation,
                    labelnames=labels,
                    multiprocess_mode="mostrecent",
                )
            else:
                self._counters[spec.name] = self._counter_cls(
                    name=f"vllm:kvconn_{spec.name}", documentation=spec.documentation, labelnames=labels
                )

        def _split(self, key: str) -> tuple[str, str] | None:
            """``"<connector>.<metric>"`` as its two parts (``None``: no hosted connector's key)."""
            if key not in self._split_cache:
                found = next((n for n in self._names if key.startswith(n + ".")), None)
                self._split_cache[key] = None if found is None else (found, key[len(found) + 1 :])
            return self._split_cache[key]

        def _child(self, family: Any, engine_idx: int, *values: str) -> Any:
            key = (id(family), engine_idx, *values)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = family.labels(*self.per_engine_labelvalues[engine_idx], *values)
            return child

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, value in transfer_stats_data.items():
                if key == GAUGES:
                    for gauge, level in value.items():
                        if (parts := self._split(gauge)) and parts[1] in self._gauges:
                            self._child(self._gauges[parts[1]], engine_idx, parts[0]).set(level)
                elif key == SECONDS:
                    for timed, observed in value.items():
                        if (parts := self._split(timed)) and parts[1] in self._seconds:
                            child = self._child(self._seconds[parts[1]], engine_idx, parts[0])
                            for seconds in observed:
                                child.observe(seconds)
                elif (parts := self._split(key)) is not None and value > 0:
                    connector, metric = parts
                    if metric.startswith(DEGRADED_PREFIX):
                        reason = metric[len(DEGRADED_PREFIX) :]
                        self._child(self._degraded, engine_idx, connector, reason).inc(value)
                    elif metric in self._counters:
                        self._child(self._counters[metric], engine_idx, connector).inc(value)

    return KVConnVllmPromMetrics
