"""The mooncake connector (embedded backend) passes every check of kvconn's conformance suite.

With its defaults (prompt blocks only, sync loads through staging), with ``save_decode`` on, and with
``load_async`` on (each value read straight into the KV caches and verified there).
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
