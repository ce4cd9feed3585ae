"""``--junit``: one testsuite per connector, a testcase per check, failures, skips and load errors."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvconn.testing.conformance import ConnectorReport
from kvconn_cli.errors import UsageError
from kvconn_cli.junit import write_junit


def test_junit_document(sample_reports: list[ConnectorReport], tmp_path: Path) -> None:
    path = tmp_path / "out.xml"
    write_junit(sample_reports, path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "4",
        "failures": "1",
        "errors": "1",
        "skipped": "1",
    }
    good, bad = root.findall("testsuite")
    assert good.get("name") == "leaky" and good.get("tests") == "3"
    cases = {c.get("name"): c for c in good.findall("testcase")}
    assert set(cases) == {"KV001", "KV032", "KV040"}
    assert all(c.get("classname") == "kvconn.leaky" for c in cases.values())
    assert list(cases["KV001"]) == []
    failure = cases["KV032"].find("failure")
    assert failure is not None and failure.text is not None and "fix: forget finished requests" in failure.text
    skipped = cases["KV040"].find("skipped")
    assert skipped is not None and skipped.get("message") == "does not load"
    (load,) = bad.findall("testcase")
    error = load.find("error")
    assert load.get("name") == "load" and error is not None and "ImportError: nope" in (error.get("message") or "")


def test_unwritable_junit_path(sample_reports: list[ConnectorReport], tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot write --junit file"):
        write_junit(sample_reports, tmp_path / "missing-dir" / "out.xml")
