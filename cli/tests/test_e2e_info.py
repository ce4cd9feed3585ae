"""End to end: ``kvconn info`` on installed connectors, paths, unknown and broken ones."""

from __future__ import annotations

import json
from collections.abc import Callable

from .conftest import RunKvconn


def test_info_json_of_the_dummy(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("info", "dummy", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["name"] == "dummy" and info["status"] == "ok"
    assert info["description"] == "Finds the blocks each step fills, as a full-block saver must; moves no KV."
    assert info["config_doc"] == "Options of the dummy connector."
    assert [(f["name"], f["type"], f["default"], f["required"]) for f in info["config"]] == [
        ("record_calls", "bool", True, False)
    ]
    assert {"build_connector_meta", "request_finished", "get_finished"} <= set(info["hooks"])
    assert "wait_for_save" not in info["hooks"]  # only what the class implements


def test_info_text_of_the_dummy(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("info", "dummy")
    assert proc.returncode == 0, proc.stderr
    assert "Finds the blocks each step fills, as a full-block saver must; moves no KV." in proc.stdout
    assert "record_calls" in proc.stdout and "build_connector_meta" in proc.stdout


def test_info_of_a_class_path(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("info", "kvconn_dummy:DummyConnector", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["target"] == "kvconn_dummy:DummyConnector" and info["distribution"] is None


def test_info_unknown_name_suggests_and_exits_2(run_kvconn: RunKvconn, make_env: Callable[..., dict[str, str]]) -> None:
    proc = run_kvconn("info", "dumy", env=make_env())  # unfiltered: the suggestion comes from every installed name
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvconn: error: ")
    assert "'dumy'" in lines[0] and "did you mean 'dummy'" in lines[0]


def test_info_broken_plugin_exits_1_without_traceback(run_kvconn: RunKvconn, broken_env: dict[str, str]) -> None:
    proc = run_kvconn("info", "e2e-import-error", env=broken_env)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "libfoo.so.1" in proc.stderr


def test_info_module_path_that_does_not_import(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("info", "no_such_module_xyz:Connector")
    assert proc.returncode == 1
    assert "no_such_module_xyz" in proc.stderr and "Traceback" not in proc.stderr
