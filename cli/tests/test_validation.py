"""``kvconn validate``'s up-front checks: what is a usage error, found before any check runs."""

from __future__ import annotations

import pytest

from kvconn.testing.conformance import list_checks
from kvconn_cli.errors import UsageError
from kvconn_cli.validation import preflight, resolve_targets, select_checks


def test_targets_in_order_without_duplicates() -> None:
    targets = resolve_targets(["dummy", "dummy"], True, ["kvconn_dummy:DummyConnector"])
    assert targets[0] == "dummy" and targets.count("dummy") == 1
    assert targets[-1] == "kvconn_dummy:DummyConnector"


@pytest.mark.parametrize(
    ("names", "all_installed", "modules", "message"),
    [
        ([], False, [], "name the connectors to validate, or pass --all, --module"),
        (["dumy"], False, [], "no connector named 'dumy'.*did you mean 'dummy'"),
        ([], False, ["just_a_module"], "--module 'just_a_module' is not a connector path"),
        ([], False, [":Class"], "is not a connector path"),
    ],
)
def test_target_usage_errors(names: list[str], all_installed: bool, modules: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        resolve_targets(names, all_installed, modules)


def test_all_with_nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONN_PLUGINS", "nothing-here")
    with pytest.raises(UsageError, match="--all found no installed connector"):
        resolve_targets([], True, [])


def test_select_checks() -> None:
    checks = list_checks()
    assert select_checks(checks, None) == checks
    first = checks[0]
    assert first in select_checks(checks, first.id)
    assert first in select_checks(checks, first.name.upper())  # case-insensitive, like run_conformance
    with pytest.raises(UsageError, match="--check 'no-such-check' matches no check"):
        select_checks(checks, "no-such-check")


def test_preflight_reports_load_problems_and_refuses_bad_config() -> None:
    problems = preflight(["dummy", "no_such_module_xyz:Connector"], {"record_calls": False})
    assert [p.target for p in problems] == ["no_such_module_xyz:Connector"]
    assert "no_such_module_xyz" in str(problems[0].error)
    with pytest.raises(UsageError, match=r"field 'record_calls'.*expected `?bool"):
        preflight(["dummy"], {"record_calls": "maybe"})
    with pytest.raises(UsageError, match=r"unknown field.*valid fields: record_calls"):
        preflight(["dummy"], {"recrod_calls": True})
