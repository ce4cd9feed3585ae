"""The offload connector passes every check of kvconn's conformance suite."""

from __future__ import annotations

from kvconn.testing import ConnectorConformance


class TestOffloadConformance(ConnectorConformance):
    connector = "offload"
