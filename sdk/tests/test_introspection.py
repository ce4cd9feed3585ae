"""``kvconn.introspection``: the answers engines and tools read about a connector are the ones the host acts on."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import kvconn
from kvconn import ConnectorConfigError, ConnectorHost, KVConnectorRole
from kvconn.introspection import (
    ENTRY_POINT_GROUP,
    build_config,
    connector_roles,
    declared_side,
    hook_object,
    implemented_hooks,
)
from kvconn.store.scheduler import StoreScheduler
from kvconn.testing.memory_store import MemoryStoreConfig, MemoryStoreConnector
from kvconn.testing.raw_hook_connector import HookReferenceConnector

STORE = "kvconn.testing.memory_store:MemoryStoreConnector"


class SchedulerOnly(HookReferenceConnector):
    roles = frozenset({KVConnectorRole.SCHEDULER})


def test_the_shipped_connectors_are_declared_in_the_entry_point_group() -> None:
    assert "dummy" in {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "dummy" in kvconn.available_connectors()


def test_roles_are_both_unless_the_class_narrows_them() -> None:
    assert connector_roles(HookReferenceConnector) == {KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER}
    assert connector_roles(SchedulerOnly) == {KVConnectorRole.SCHEDULER}


def test_a_side_is_a_class_a_path_left_unimported_or_none() -> None:
    assert declared_side(MemoryStoreConnector, KVConnectorRole.SCHEDULER.value) is StoreScheduler
    assert declared_side(MemoryStoreConnector, KVConnectorRole.WORKER.value) == "kvconn.store.worker:StoreWorker"
    assert declared_side(HookReferenceConnector, KVConnectorRole.WORKER.value) is None
    # Reading a path imports nothing: the store's worker side (torch) stays out of a tool's process.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvconn.introspection import declared_side; "
            f"from {STORE.replace(':', ' import ')}; declared_side(MemoryStoreConnector, 'worker'); "
            "print(sorted({'torch', 'kvconn.store.worker'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


def test_the_hook_object_is_the_side_the_host_calls_and_its_hooks_are_what_the_host_dispatches() -> None:
    host = ConnectorHost.from_names([STORE], role=KVConnectorRole.SCHEDULER)
    connector = host.connectors[STORE]
    side = hook_object(connector)
    assert isinstance(side, StoreScheduler) and side is connector.side
    hooks = implemented_hooks(StoreScheduler, by_name=True)
    assert "build_connector_meta" in hooks and "save_kv_layer" not in hooks
    assert all(STORE in host.implementers(hook) for hook in hooks)
    # A connector that is its own hooks answers for itself.
    own = kvconn.load_connector(f"{__name__}:SchedulerOnly", role=KVConnectorRole.SCHEDULER)
    assert hook_object(own) is own
    host.shutdown()


def test_a_config_is_validated_as_load_connector_validates_it() -> None:
    config = build_config(MemoryStoreConnector, {"store": "introspection"}, name="store")
    assert isinstance(config, MemoryStoreConfig) and config.store == "introspection"
    with pytest.raises(ConnectorConfigError, match=r"invalid config for connector 'store': .*'no_such_field'"):
        build_config(MemoryStoreConnector, {"no_such_field": 1}, name="store")
