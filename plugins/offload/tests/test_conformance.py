"""The offload connector passes every check of kvconn's conformance suite."""

from __future__ import annotations

from kvconn.testing import ConnectorConformance


class TestOffloadConformance(ConnectorConformance):
    connector = "offload"


class TestOffloadAsyncLoadsConformance(ConnectorConformance):
    """Async loads (``load_async: true``, the default on an accelerator; the reference engine's KV caches are in host
    memory, where the default loads in the step) pass the same checks."""

    connector = "offload"
    config = {"load_async": True}  # noqa: RUF012 (the suite's ClassVar)
