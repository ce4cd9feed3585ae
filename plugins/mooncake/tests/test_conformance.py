"""The mooncake connector (embedded backend) passes every check of kvconn's conformance suite.

Both with its defaults (prompt blocks only) and with ``save_decode`` on.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvconn.testing import ConnectorConformance


class TestMooncakeEmbeddedConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {"backend": "embedded", "embedded_store": "conformance"}


class TestMooncakeEmbeddedDecodeCacheConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {
        "backend": "embedded",
        "embedded_store": "conformance-decode",
        "save_decode": True,
    }
