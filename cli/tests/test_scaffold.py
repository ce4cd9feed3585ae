"""``kvconn new``'s names, templates and refusal to overwrite."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

import kvconn
from kvconn_cli.errors import UsageError
from kvconn_cli.scaffold import Scaffold, check_name, plan, write


@pytest.mark.parametrize(
    ("name", "package", "distribution", "prefix"),
    [
        ("mystore", "kvconn_mystore", "kvconn-mystore", "Mystore"),
        ("my-store", "kvconn_my_store", "kvconn-my-store", "MyStore"),
        ("lm_cache2", "kvconn_lm_cache2", "kvconn-lm-cache2", "LmCache2"),
    ],
)
def test_names(name: str, package: str, distribution: str, prefix: str) -> None:
    assert Scaffold.for_name(name) == Scaffold(name, package, distribution, prefix)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "empty"),
        ("2fast", "not a lowercase slug"),
        ("my--store", "not a lowercase slug"),
        ("store-", "not a lowercase slug"),
        ("pkg.mod:Class", "not a lowercase slug"),
        ("MyStore", "try 'mystore'"),
        ("x" * 41, "at most 40"),
    ],
)
def test_bad_names(name: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        check_name(name)


def test_plan_renders_a_store_connector_by_default(tmp_path: Path) -> None:
    files = plan(Scaffold.for_name("my-store"), tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in files) == [
        "README.md",
        "pyproject.toml",
        "src/kvconn_my_store/__init__.py",
        "tests/test_conformance.py",
        "tests/test_store.py",
    ]
    assert not any("${" in text for text in files.values())
    source = files[tmp_path / "src/kvconn_my_store/__init__.py"]
    classes = {n.name for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    assert classes == {"MyStoreConfig", "MyStoreConnector", "MyStoreStore"}
    assert "class MyStoreConnector(StoreConnector):" in source


def test_plan_renders_every_hooks_template(tmp_path: Path) -> None:
    files = plan(Scaffold.for_name("my-store", hooks=True), tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in files) == [
        "README.md",
        "pyproject.toml",
        "src/kvconn_my_store/__init__.py",
        "tests/test_conformance.py",
    ]
    assert not any("${" in text for text in files.values())
    pyproject = tomllib.loads(files[tmp_path / "pyproject.toml"])
    assert pyproject["project"]["name"] == "kvconn-my-store"
    assert pyproject["project"]["entry-points"]["kvconn.connectors"] == {"my-store": "kvconn_my_store:MyStoreConnector"}
    source = files[tmp_path / "src/kvconn_my_store/__init__.py"]
    classes = {n.name for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    assert classes == {
        "MyStoreConfig",
        "MyStoreMetadata",
        "MyStoreConnector",
        "MyStoreScheduler",
        "MyStoreWorker",
        "Transfer",
        "_Tracked",
    }
    assert f'api_version = "{kvconn.API_VERSION}"' in source
    assert "scheduler_side = MyStoreScheduler" in source and "worker_side = MyStoreWorker" in source


def test_write_creates_and_refuses_to_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "new"
    written = write(Scaffold.for_name("abc"), target)
    assert all(p.is_file() for p in written)
    with pytest.raises(UsageError, match="not empty"):
        write(Scaffold.for_name("abc"), target)
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        write(Scaffold.for_name("abc"), tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write(Scaffold.for_name("abc"), empty)
