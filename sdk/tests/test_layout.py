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


def test_kvconn_host_exports_the_public_names_of_each_host_module_an_engine_uses() -> None:
    # The host is split by role and concept; an engine imports what it uses from kvconn.host, whichever module
    # defines it (the role hosts, LoadPlan / StepUpdate, the monitors' types, the bounds' defaults).
    import kvconn.host
    from kvconn.host import connector_host, dispatch, monitors, scheduler_host, worker_host

    building_blocks = {"HostCore", "Monitored"}  # what the host classes are built of, not what an engine names
    for module in (connector_host, scheduler_host, worker_host, monitors, dispatch):
        for name in sorted(set(module.__all__) - building_blocks):
            assert getattr(kvconn.host, name) is getattr(module, name), f"{module.__name__}.{name}"
