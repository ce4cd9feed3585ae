"""Discovery and loading by name, through real entry points."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import ClassVar

import msgspec
import pytest

import kvconn
from kvconn import (
    ConnectorConfigError,
    ConnectorLoadError,
    ConnectorNotFoundError,
    KVConnector,
    KVConnectorRole,
    available_connectors,
    load_connector,
    load_connector_class,
)

BROKEN_DIST = "kvconn-broken-fixture"


@pytest.fixture(scope="module")
def broken_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real distribution whose connector fails to import, pip-installed into this venv."""
    root = tmp_path_factory.mktemp("broken")
    (root / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"
        [project]
        name = "{BROKEN_DIST}"
        version = "0.0.1"
        [project.entry-points."kvconn.connectors"]
        broken = "kvconn_broken_fixture:Connector"
        [tool.hatch.build.targets.wheel]
        packages = ["kvconn_broken_fixture"]
        """)
    )
    (root / "kvconn_broken_fixture").mkdir()
    (root / "kvconn_broken_fixture" / "__init__.py").write_text("import a_module_that_does_not_exist\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(root)], check=True)
    try:
        yield "broken"
    finally:
        subprocess.run([*pip, "uninstall", "-y", BROKEN_DIST], check=True)


def test_installed_dummy_is_found_through_its_entry_point() -> None:
    entry = available_connectors()["dummy"]
    assert entry.target == "kvconn_dummy:DummyConnector"
    assert entry.distribution == "kvconn-dummy"
    connector = load_connector("dummy", role="scheduler")
    assert type(connector).__name__ == "DummyConnector"
    assert connector.role is KVConnectorRole.SCHEDULER


def test_unknown_name_lists_installed_names_and_suggests_the_closest() -> None:
    with pytest.raises(ConnectorNotFoundError) as err:
        load_connector("dumy", role="worker")
    message = str(err.value)
    assert "'dumy'" in message and "dummy" in message and "did you mean 'dummy'?" in message


def test_broken_plugin_is_reported_with_its_distribution_and_others_still_load(broken_plugin: str) -> None:
    assert broken_plugin in available_connectors()
    with pytest.raises(ConnectorLoadError) as err:
        load_connector_class(broken_plugin)
    assert BROKEN_DIST in str(err.value)
    assert "a_module_that_does_not_exist" in str(err.value)
    assert load_connector("dummy", role="worker") is not None


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("no_such_module_xyz:Thing", "failed to import module 'no_such_module_xyz'"),
        ("kvconn:NoSuchThing", "has no attribute 'NoSuchThing'"),
        ("kvconn:API_VERSION", "not a connector class"),
        ("kvconn:KVConnectorMetadata", "implements no hook: subclass kvconn.KVConnector"),
        (":Thing", "use the form 'package.module:ClassName'"),
    ],
)
def test_module_paths_that_do_not_hold_a_connector(path: str, expected: str) -> None:
    with pytest.raises(ConnectorLoadError, match=expected):
        load_connector_class(path)


class TypedConfig(msgspec.Struct, forbid_unknown_fields=True):
    renamed_fields: ClassVar[dict[str, str]] = {"pool": "pool_blocks"}

    pool_blocks: int = 8
    mode: str = "auto"


class Configured(KVConnector):
    Config = TypedConfig

    def wait_for_save(self) -> None:
        pass


class FutureApi(Configured):
    api_version = "1.99"


class OtherMajor(Configured):
    api_version = "2.0"


def test_config_is_validated_into_the_connectors_struct() -> None:
    path = f"{__name__}:Configured"
    connector = load_connector(path, role="worker", config={"pool_blocks": 4})
    assert connector.config == TypedConfig(pool_blocks=4)
    with pytest.raises(ConnectorConfigError, match=r"field 'pool_blocks': expected int, got str"):
        load_connector(path, role="worker", config={"pool_blocks": "many"})
    with pytest.raises(ConnectorConfigError, match=r"unknown field 'pool_size'.*valid fields: pool_blocks, mode"):
        load_connector(path, role="worker", config={"pool_size": 1})
    with pytest.raises(ConnectorConfigError, match=r"field 'pool' was renamed to 'pool_blocks': use the new name$"):
        load_connector(path, role="worker", config={"pool": 1})


@pytest.mark.parametrize(("cls", "why"), [("FutureApi", "newer than this SDK"), ("OtherMajor", "different major")])
def test_incompatible_api_versions_are_refused(cls: str, why: str) -> None:
    with pytest.raises(ConnectorLoadError, match=why):
        load_connector(f"{__name__}:{cls}", role="worker")


def test_environment_allow_and_block_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONN_DISABLE_PLUGINS", "dummy")
    assert "dummy" not in available_connectors()
    with pytest.raises(ConnectorNotFoundError, match=r"installed but not available.*KVCONN_DISABLE_PLUGINS"):
        load_connector("dummy", role="worker")
    monkeypatch.delenv("KVCONN_DISABLE_PLUGINS")
    monkeypatch.setenv("KVCONN_PLUGINS", "something-else")
    assert "dummy" not in available_connectors()
    monkeypatch.setenv("KVCONN_PLUGINS", "dummy, something-else")
    assert "dummy" in available_connectors()


def test_import_kvconn_does_not_import_torch_or_plugins() -> None:
    code = (
        "import sys, kvconn; kvconn.available_connectors(); "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'kvconn_'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
    assert kvconn.API_VERSION == "1.0"
