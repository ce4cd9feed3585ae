"""The offload connector passes every check of kvconn's conformance suite."""

from __future__ import annotations

from kvconn.testing import ConnectorConformance


class TestOffloadConformance(ConnectorConformance):
    connector = "offload"


class TestOffloadSyncLoadsConformance(ConnectorConformance):
    """Sync loads (``load_async: false``, for KV caches in host memory) pass the same checks."""

    connector = "offload"
    config = {"load_async": False}  # noqa: RUF012 (the suite's ClassVar)
