"""The mooncake connector (embedded backend) passes every check of kvconn's conformance suite.

``save_decode_cache`` is on: KV040 reuses a block that was filled during decode,
which the connector saves only when asked (its default saves prompt blocks only).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvconn.testing import ConnectorConformance


class TestMooncakeEmbeddedConformance(ConnectorConformance):
    connector = "mooncake"
    config: ClassVar[dict[str, Any]] = {
        "backend": "embedded",
        "embedded_store": "conformance",
        "save_decode_cache": True,
    }
