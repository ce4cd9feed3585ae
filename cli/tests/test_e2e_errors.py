"""End to end: the mistakes a new connector author makes, and the messages that name the fix.

Each test runs the installed ``kvconn`` executable on a small connector
written to a temporary directory (on ``PYTHONPATH``, or pip-installed there),
and asserts the text the author reads.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Callable
from importlib.metadata import distribution
from pathlib import Path

import pytest

from kvconn_cli.app import app
from kvconn_cli.output import SCHEMA_VERSION

from .conftest import RunKvconn, write_distribution

#: Connectors with an author's mistake each, importable as ``authors_mistakes:<Class>``.
_MISTAKES = '''
import msgspec

import kvconn


class FsConfig(msgspec.Struct, forbid_unknown_fields=True):
    directory: str


class NeedsDirectory(kvconn.KVConnector):
    """A Config field without a default."""

    Config = FsConfig
    api_version = "1.0"

    def get_num_tracked_requests(self) -> int:
        return 0


class NoHooks(kvconn.KVConnector):
    """Subclasses KVConnector, implements nothing."""

    api_version = "1.0"


class LongWinded(kvconn.KVConnector):
    """Its check messages are long: they must not wrap when stdout is not a terminal."""

    Config = FsConfig
    api_version = "1.0"

    def get_num_tracked_requests(self) -> int:
        return 0
'''


@pytest.fixture
def mistakes_env(tmp_path: Path, make_env: Callable[..., dict[str, str]]) -> dict[str, str]:
    (tmp_path / "authors_mistakes.py").write_text(_MISTAKES)
    return make_env(tmp_path, KVCONN_PLUGINS="dummy")


def test_a_required_config_field_is_a_config_defaults_failure_naming_the_option(
    run_kvconn: RunKvconn, mistakes_env: dict[str, str]
) -> None:
    expected = (
        "connector authors_mistakes:NeedsDirectory needs option `directory`; give it a default "
        "(engines load connectors with no options) or pass --config '{\"directory\": ...}'"
    )
    proc = run_kvconn("validate", "authors_mistakes:NeedsDirectory", "--json", env=mistakes_env)
    assert proc.returncode == 1
    (report,) = json.loads(proc.stdout)["connectors"]
    assert "load_error" not in report and (report["failed"], report["passed"]) == (1, 0)
    kv004 = next(c for c in report["checks"] if c["id"] == "KV004")
    assert kv004["status"] == "failed" and expected in kv004["message"]
    assert all(c["status"] == "skipped" and "(KV004)" in c["message"] for c in report["checks"] if c is not kv004)

    text = run_kvconn("validate", "authors_mistakes:NeedsDirectory", env=mistakes_env)
    assert expected in text.stdout and f"0 passed, 1 failed, {len(report['checks']) - 1} skipped" in text.stdout

    given = run_kvconn(
        "validate", "authors_mistakes:NeedsDirectory", "--config", '{"directory": "x"}', "--json", env=mistakes_env
    )
    (report,) = json.loads(given.stdout)["connectors"]
    assert report["passed"] > 0  # the other checks run with the config given


def test_a_connector_with_no_hook_is_told_it_implements_none(
    run_kvconn: RunKvconn, mistakes_env: dict[str, str]
) -> None:
    proc = run_kvconn("validate", "authors_mistakes:NoHooks", env=mistakes_env)
    assert proc.returncode == 1
    assert (
        "NoHooks implements no hook: define methods named after the hooks in kvconn.hookspecs "
        "(build_connector_meta, save_kv_layer, ...)" in proc.stdout
    )
    assert "subclass kvconn.KVConnector" not in proc.stdout  # it already does


def test_a_forgotten_entry_point_prints_the_pyproject_lines(
    tmp_path: Path,
    run_kvconn: RunKvconn,
    pip_install: Callable[[Path, Path], None],
    make_env: Callable[..., dict[str, str]],
) -> None:
    project = tmp_path / "kvconn-forgot"
    connector = """
        import kvconn


        class ForgotConnector(kvconn.KVConnector):
            api_version = "1.0"

            def get_num_tracked_requests(self) -> int:
                return 0
    """
    write_distribution(project, "kvconn-forgot", {"__init__": connector}, version="0.3.0",
                       extra_toml='dependencies = ["kvconn-sdk"]')  # fmt: skip
    site = tmp_path / "site"
    pip_install(project, site)
    env = make_env(site, KVCONN_PLUGINS="dummy")
    lines = '    [project.entry-points."kvconn.connectors"]\n    forgot = "kvconn_forgot:ForgotConnector"\n'
    intro = (
        "kvconn: warning: kvconn-forgot 0.3.0 looks like a kvconn connector but declares no entry point in the "
        "group 'kvconn.connectors', so it cannot be loaded by name; add these lines to its pyproject.toml, "
        f"then reinstall it: {shlex.join([sys.executable, '-m', 'pip', 'install', str(project)])}:\n"
    )

    listed = run_kvconn("list", env=env)
    assert listed.returncode == 0 and intro + lines in listed.stderr

    validated = run_kvconn("validate", "forgot", env=env)
    assert validated.returncode == 2 and intro + lines in validated.stderr
    assert validated.stderr.endswith("kvconn: error: no connector named 'forgot' is installed (installed: dummy). "
                                     "Install its distribution, or pass 'package.module:ClassName'.\n")  # fmt: skip


def test_an_engine_adapter_is_not_taken_for_a_forgotten_connector() -> None:
    """kvconn-vllm (installed by `make install`) declares a conformance driver, not a connector: no warning."""
    from kvconn_cli.unregistered import find_unregistered

    assert distribution("kvconn-vllm").entry_points.select(group="kvconn.conformance_drivers")
    assert "kvconn-vllm" not in {u.distribution for u in find_unregistered()}


@pytest.mark.parametrize("command", ["", *(str(c.name) for c in app.registered_commands)])
def test_dash_h_is_help_everywhere(run_kvconn: RunKvconn, command: str) -> None:
    proc = run_kvconn(*filter(None, [command]), "-h")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"Usage: kvconn {command} [OPTIONS]".replace("  ", " "))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["validate", "--frobnicate"], "no such option: --frobnicate (see 'kvconn validate --help')"),
        (
            ["simulate", "--connector", "dummy", "--requests", "many"],
            "invalid value for '--requests': Input should be a valid integer, unable to parse string as an "
            "integer (see 'kvconn simulate --help')",
        ),
        (["frobnicate"], "no such command 'frobnicate' (see 'kvconn --help')"),
        (["info"], "missing argument 'NAME' (see 'kvconn info --help')"),
    ],
)
def test_click_usage_errors_are_one_kvconn_error_line(run_kvconn: RunKvconn, args: list[str], expected: str) -> None:
    proc = run_kvconn(*args)
    assert proc.returncode == 2
    assert proc.stderr == f"kvconn: error: {expected}\n" and proc.stdout == ""


def test_text_is_printed_as_given_not_as_emoji(run_kvconn: RunKvconn) -> None:
    proc = run_kvconn("validate", "nomod:X")
    assert proc.returncode == 1
    assert "nomod:X: cannot load: connector path 'nomod:X' failed to import module 'nomod'" in proc.stdout
    assert "❌" not in proc.stdout + proc.stderr


def test_tables_are_plain_unwrapped_columns_when_stdout_is_not_a_terminal(
    run_kvconn: RunKvconn, mistakes_env: dict[str, str]
) -> None:
    proc = run_kvconn("validate", "authors_mistakes:LongWinded", env={**mistakes_env, "COLUMNS": "40"})
    kv004 = [line for line in proc.stdout.splitlines() if line.startswith("KV004")]
    assert len(kv004) == 1 and "needs option `directory`; give it a default" in kv004[0]
    assert kv004[0].rstrip().endswith("so that the connector loads with no config")  # the fix, same line
    assert not any(char in proc.stdout for char in "│┃━─")


def test_human_messages_go_to_stderr_and_json_carries_a_schema_version(run_kvconn: RunKvconn, tmp_path: Path) -> None:
    plot = tmp_path / "run.png"
    proc = run_kvconn(
        "simulate", "--connector", "dummy", "--connector", "dummy", "--requests", "4", "--json", "--plot", str(plot)
    )
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {plot}" in proc.stderr and plot.is_file()
    document = json.loads(proc.stdout)
    assert document["schema_version"] == SCHEMA_VERSION
    # the same connector given twice: two runs, two labels
    assert [run["label"] for run in document["runs"]] == ["dummy", "dummy #2"]

    for args in (["list", "--json"], ["info", "dummy", "--json"], ["validate", "dummy", "--check", "KV001", "--json"]):
        assert json.loads(run_kvconn(*args).stdout)["schema_version"] == SCHEMA_VERSION

    created = run_kvconn("new", "mine", "--dir", str(tmp_path / "mine"))
    assert created.returncode == 0 and created.stdout == "" and "kvconn validate mine" in created.stderr
