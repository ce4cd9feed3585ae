"""JUnit XML for ``kvconn validate --junit FILE``: CI systems show it as test results.

One ``<testsuite>`` per connector, one ``<testcase>`` per check (classname
``kvconn.<connector>``, name the check id), with ``<failure>`` or
``<skipped>``; a connector that cannot load is one ``<testcase name="load">``
with an ``<error>``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError
from .inspection import one_line

if TYPE_CHECKING:
    from kvconn.testing.conformance import ConnectorReport

__all__ = ["check_writable", "junit_tree", "write_junit"]


def _suite(report: ConnectorReport) -> ET.Element:
    suite = ET.Element("testsuite", name=report.name)
    classname = f"kvconn.{report.name}"
    errors = 0
    if report.load_error is not None:
        case = ET.SubElement(suite, "testcase", classname=classname, name="load")
        error = ET.SubElement(case, "error", message=one_line(report.load_error), type="ConnectorLoadError")
        error.text = report.load_error
        errors = 1
    for result in report.results:
        case = ET.SubElement(suite, "testcase", classname=classname, name=result.id)
        if result.status == "failed":
            failure = ET.SubElement(case, "failure", message=one_line(result.message))
            failure.text = result.message
        elif result.status == "skipped":
            ET.SubElement(case, "skipped", message=result.message)
    tests = len(report.results) + errors
    suite.attrib.update(tests=str(tests), failures=str(report.failed), errors=str(errors), skipped=str(report.skipped))
    return suite


def junit_tree(reports: Sequence[ConnectorReport]) -> ET.ElementTree:
    """The JUnit document for ``reports``."""
    root = ET.Element("testsuites", name="kvconn validate")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in reports:
        suite = _suite(report)
        root.append(suite)
        for key in totals:
            totals[key] += int(suite.get(key, "0"))
    root.attrib.update({key: str(value) for key, value in totals.items()})
    ET.indent(root)
    return ET.ElementTree(root)


def _cannot_write(path: Path, exc: OSError) -> UsageError:
    return UsageError(f"cannot write --junit file {str(path)!r}: {exc.strerror or exc}")


def check_writable(path: Path) -> None:
    """Create (truncate) ``path`` now, so an unwritable ``--junit`` fails before the checks run."""
    try:
        path.open("w", encoding="utf-8").close()
    except OSError as exc:
        raise _cannot_write(path, exc) from None


def write_junit(reports: Sequence[ConnectorReport], path: Path) -> None:
    """Write the JUnit document to ``path``; :class:`UsageError` when it cannot be written."""
    try:
        junit_tree(reports).write(path, encoding="utf-8", xml_declaration=True)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
