"""``kvconn_cli.app.main``: error presentation and exit codes, in process."""

from __future__ import annotations

import pytest

import kvconn
import kvconn_cli
from kvconn_cli import inspection
from kvconn_cli.app import COMMAND_MODULES, app, main


def _exit_code(argv: list[str]) -> int | str | None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def test_every_command_module_registers_its_command() -> None:
    names = {command.name for command in app.registered_commands} | {group.name for group in app.registered_groups}
    assert {"list", "info", "validate", "new"} <= names
    assert len(names) >= len(COMMAND_MODULES)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--version"]) == 0
    out = capsys.readouterr().out
    assert kvconn_cli.__version__ in out and kvconn.API_VERSION in out


def test_cli_errors_are_one_line_with_their_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["info", "dumy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvconn: error: no connector named 'dumy'") and err.count("\n") == 1


def test_unexpected_errors_are_one_line_unless_debugging(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(inspection, "summarize_all", boom)
    monkeypatch.delenv("KVCONN_DEBUG", raising=False)
    assert _exit_code(["list"]) == 1
    err = capsys.readouterr().err
    assert err == "kvconn: error: internal error: RuntimeError: boom (rerun with KVCONN_DEBUG=1 to see the traceback)\n"
    monkeypatch.setenv("KVCONN_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["list"])
