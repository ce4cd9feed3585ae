"""The mooncake connector (embedded backend) passes every check of kvconn's conformance suite.

With its defaults (prompt blocks only, sync loads through staging, each step's put on a store thread behind the
next step), with ``save_decode`` on, with ``load_async`` on (each value read straight into the KV caches and verified
there), and with ``save_async`` off (each put in ``wait_for_save``, straight from the KV caches).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvconn.testing import ConnectorConformance

EMBEDDED = {"backend": "embedded", "embedded_store": "conformance"}


class TestMooncakeEmbeddedConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = EMBEDDED


class TestMooncakeEmbeddedDecodeCacheConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {
        "backend": "embedded",
        "embedded_store": "conformance-decode",
        "save_decode": True,
    }


class TestMooncakeEmbeddedAsyncInPlaceConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {**EMBEDDED, "embedded_store": "conformance-async", "load_async": True}


class TestMooncakeEmbeddedSavesSyncConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {**EMBEDDED, "embedded_store": "conformance-saves-sync", "save_async": False}
