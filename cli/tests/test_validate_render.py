"""How ``kvconn validate`` shows results on a terminal-less stdout: the table and the verdict lines."""

from __future__ import annotations

import pytest

from kvconn.testing.conformance import CheckResult, ConnectorReport
from kvconn_cli.commands.validate import _render


def test_failures_skips_and_load_errors_are_shown(
    sample_reports: list[ConnectorReport], capsys: pytest.CaptureFixture[str]
) -> None:
    _render(sample_reports, debug_hint=True)
    captured = capsys.readouterr()
    out = captured.out
    assert "kvconn validate leaky" in out
    # Not a terminal: plain columns, one line per check, observed then fix, never wrapped.
    kv032 = next(line for line in out.splitlines() if "KV032" in line)
    assert "no-leaks" in kv032 and "failed" in kv032 and "observed 3 tracked; fix: forget" in kv032  # as the JSON
    assert "│" not in out and "─" not in out
    assert "leaky: FAILED  1 passed, 1 failed, 1 skipped" in out
    assert "gone: cannot load: connector 'gone' failed to import module 'x': ImportError: nope" in out
    assert "rerun with --debug" in captured.err and "rerun" not in out  # a hint for people: stderr
    assert "gone: FAILED  0 passed, 0 failed, 0 skipped" in out


def test_all_passing(capsys: pytest.CaptureFixture[str]) -> None:
    _render([ConnectorReport("good", [CheckResult("KV001", "found", "passed")])], debug_hint=False)
    out = capsys.readouterr().out
    assert "good: ok  1 passed, 0 failed, 0 skipped" in out and "rerun" not in out


def test_checks_not_run_because_of_a_root_cause_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    results = [
        CheckResult("KV002", "imports", "failed", "observed a bad hook; fix: name it right"),
        CheckResult("KV010", "scenarios", "skipped", "not run: KV002 imports failed first (the root cause): fix it"),
    ]
    _render([ConnectorReport("broken", results)], debug_hint=False)
    kv010 = next(line for line in capsys.readouterr().out.splitlines() if "KV010" in line)
    assert "not run" in kv010 and "skipped" not in kv010
