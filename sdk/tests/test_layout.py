"""The names DESIGN.md promises keep working after the reference engine moved to ``kvconn.reference``."""

from __future__ import annotations

import kvconn.engine
import kvconn.reference


def test_kvconn_engine_is_the_reference_engine_under_its_old_name() -> None:
    assert kvconn.engine.__all__ == kvconn.reference.__all__
    for name in kvconn.reference.__all__:
        assert getattr(kvconn.engine, name) is getattr(kvconn.reference, name), name


def test_kvconn_host_exports_every_public_name_of_the_connector_host_module() -> None:
    # A monitor's callback types (MonitorBefore, MonitorAfter) are public: importable from kvconn.host, not only
    # from the module behind it.
    import kvconn.host
    import kvconn.host.connector_host

    missing = sorted(set(kvconn.host.connector_host.__all__) - set(kvconn.host.__all__))
    assert not missing
    for name in kvconn.host.connector_host.__all__:
        assert getattr(kvconn.host, name) is getattr(kvconn.host.connector_host, name), name
