"""``kvconn validate``: run the conformance checks against connectors and report.

Exit codes: 0 every check passed (or was skipped), 1 a check failed or a
connector cannot be loaded, 2 a usage error (found before any check runs).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from kvconn.testing.conformance import CheckResult, ConfigFactory, ConnectorReport

__all__ = ["Driver", "register", "validate"]

#: Marks a ``--vllm-connector`` target among the targets (run through ``kvconn_vllm.testing.native``).
NATIVE_PREFIX = "vllm-connector:"


class Driver(str, enum.Enum):
    """The engine that drives the connector through the checks."""

    reference = "reference"
    vllm = "vllm"
    sglang = "sglang"  # store connectors as SGLang's HiCache storage tier (kvconn_sglang.testing.checks)


def validate(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="NAME",
            help="Installed connector names (or 'package.module:ClassName' paths).",
            show_default=False,
        ),
    ] = None,
    all_installed: Annotated[bool, typer.Option("--all", help="Validate every installed connector.")] = False,
    modules: Annotated[
        list[str] | None,
        typer.Option(
            "--module",
            metavar="PKG.MOD:CLASS",
            help="Validate a connector class that is not installed: 'package.module:ClassName'.",
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option("--config", metavar="JSON", help="Connector config as a JSON object: '{\"field\": 1}'."),
    ] = None,
    config_file: Annotated[
        Path | None, typer.Option("--config-file", metavar="FILE", help="Read the connector config from a JSON file.")
    ] = None,
    config_factory: Annotated[
        str | None,
        typer.Option(
            "--config-factory",
            metavar="PKG.MOD:FUNCTION",
            help="A function f(run) or f(run, directory) -> config, called for each scenario and data run in place "
            "of the connector's own fresh_store_config: a fresh store per run for a connector whose store outlives "
            "its instances (and the lost-blocks part of KV041); directory is the run's own, removed afterwards.",
        ),
    ] = None,
    check: Annotated[
        str | None,
        typer.Option(
            "--check", metavar="PATTERN", help="Run only the checks whose id or name matches this pattern ('KV01*')."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"connectors": [...]} as JSON on stdout.')] = False,
    junit: Annotated[
        Path | None, typer.Option("--junit", metavar="FILE", help="Also write the results as JUnit XML to this file.")
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Show every log line as it comes, the engines' own (vLLM, torch) included; without it each "
            "distinct warning is shown once, counted, after the report.",
        ),
    ] = False,
    engine: Annotated[Driver, typer.Option("--engine", help="The engine that drives the checks.")] = Driver.reference,
    vllm_connectors: Annotated[
        list[str] | None,
        typer.Option(
            "--vllm-connector",
            metavar="NAME",
            help="With --engine vllm: validate a vLLM connector (a name in vLLM's KVConnectorFactory, or "
            "'pkg.mod:Class' of a KVConnectorBase_V1 subclass); --config is its kv_connector_extra_config.",
        ),
    ] = None,
    wait_s: Annotated[
        float | None,
        typer.Option(
            "--wait-s",
            metavar="SECONDS",
            min=0.001,
            help="How long a run waits for a connector's async loads and saves without progress before calling it "
            "stuck (default 10; also KVCONN_VALIDATE_WAIT_S): raise it for a store behind a slow socket.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run the conformance checks against connectors: a table of results, exit 1 if any fails.

    The config given applies to every connector validated.
    """
    from kvconn.testing.conformance import ConnectorReport, list_checks
    from kvconn.testing.conformance.waits import WAIT_ENV

    from ..config_input import read_config
    from ..errors import EXIT_FAILURE
    from ..inspection import plugin_output_to_stderr
    from ..junit import check_writable, write_junit
    from ..logs import WarningSummary, configure_logging, debug_from_env
    from ..output import err_console, print_json, print_traceback
    from ..validation import check_vllm_connectors, preflight, resolve_targets, select_checks

    debug = debug or debug_from_env()
    if wait_s is not None:  # through the environment, so that worker processes the checks start get it too
        os.environ[WAIT_ENV] = repr(wait_s)
    configure_logging(debug, verbose=verbose)
    config_map = read_config(config, config_file)
    native = check_vllm_connectors(vllm_connectors or [], engine.value, config_factory)
    with plugin_output_to_stderr():  # the factory's module is the author's code: its prints must not reach --json
        factory = _load_config_factory(config_factory) if config_factory else None
    kvconn_targets = resolve_targets(names or [], all_installed, modules or [], others=bool(native))
    num_checks = _sglang_checks(check) if engine is Driver.sglang else len(select_checks(list_checks(), check))
    if junit is not None:
        check_writable(junit)
    problems = {p.target: p for p in preflight(kvconn_targets, config_map)}
    targets = [*kvconn_targets, *(f"{NATIVE_PREFIX}{name}" for name in native)]
    if debug:
        for problem in problems.values():
            print_traceback(problem.error)

    summary = None if debug or verbose else WarningSummary().install()

    def run(target: str, on_result: Callable[[CheckResult], None]) -> ConnectorReport:
        if target in problems:  # known not to load: report it without importing it again
            return ConnectorReport(name=target, results=[], load_error=problems[target].message)
        if summary is not None:
            on_result = summary.attributing(on_result)
        if target.startswith(NATIVE_PREFIX):
            native = target.removeprefix(NATIVE_PREFIX)
            return _run_through(*_ADAPTER_RUNS["native"], native, config_map, check, on_result, debug)
        if engine is Driver.sglang:
            return _run_through(*_ADAPTER_RUNS["sglang"], target, config_map, check, on_result, debug)
        return _run_one(target, config_map, factory, check, engine.value, on_result, debug)

    try:
        with plugin_output_to_stderr():
            reports = _run_with_progress(err_console(), targets, num_checks, run)
        if junit is not None:
            write_junit(reports, junit)
        if as_json:
            print_json({"connectors": [r.to_dict() for r in reports]})
        else:
            _render(reports, debug_hint=bool(problems) and not debug)
    finally:
        if summary is not None:
            summary.report()
    if not all(r.ok for r in reports):
        raise typer.Exit(EXIT_FAILURE)


def _sglang_checks(select: str | None) -> int:
    """How many SGLang checks ``--check`` selects (for the progress line); 0 without kvconn-sglang."""
    try:
        from kvconn_sglang.testing.checks import selected
    except ImportError:
        return 0
    return len(selected(select))


def _load_config_factory(path: str) -> ConfigFactory:
    """The ``--config-factory`` function, or a usage error saying what is wrong with ``path``."""
    import importlib

    from ..errors import UsageError

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--config-factory takes 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # a module calling sys.exit must not end kvconn silently
        raise UsageError(f"--config-factory {path!r}: cannot import {module_name!r}: {exc!r}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--config-factory {path!r}: module {module_name!r} has no function {attr!r}")
    return cast("ConfigFactory", factory)


def _run_one(
    target: str,
    config: dict[str, Any] | None,
    config_factory: ConfigFactory | None,
    select: str | None,
    driver: str,
    on_result: Callable[[CheckResult], None],
    debug: bool,
) -> ConnectorReport:
    """One connector's run; an exception escaping the suite becomes that connector's load error."""
    from kvconn.testing.conformance import ConnectorReport, run_conformance

    from ..inspection import reason
    from ..output import print_traceback

    try:
        return run_conformance(
            target, config=config, select=select, on_result=on_result, driver=driver, config_factory=config_factory
        )
    except (Exception, SystemExit) as exc:  # a plugin calling sys.exit must not end the other connectors' runs
        if debug:
            print_traceback(exc)
        return ConnectorReport(name=target, results=[], load_error=f"the conformance run stopped: {reason(exc)}")


#: The runs an adapter holds (``--vllm-connector``, ``--engine sglang``): its runner, and what to install for it.
_ADAPTER_RUNS = {
    "native": ("kvconn_vllm.testing.native:run_native_conformance", "--vllm-connector needs kvconn-vllm"),
    "sglang": ("kvconn_sglang.testing.checks:run_sglang_conformance", "--engine sglang needs kvconn-sglang"),
}


def _run_through(
    runner: str,
    needs: str,
    name: str,
    config: dict[str, Any] | None,
    select: str | None,
    on_result: Callable[[CheckResult], None],
    debug: bool,
) -> ConnectorReport:
    """A run by an adapter's ``runner`` ("module:function"); a load error saying what ``needs`` installing when
    it does not import, and one saying why when the run stops."""
    import importlib

    from kvconn.testing.conformance import ConnectorReport

    from ..inspection import reason
    from ..output import print_traceback

    module, _, function = runner.partition(":")
    try:
        run = getattr(importlib.import_module(module), function)
    except ImportError as exc:
        return ConnectorReport(name, [], load_error=f"{needs} installed: {reason(exc)}")
    try:
        report: ConnectorReport = run(name, config=config, select=select, on_result=on_result)
        return report
    except (Exception, SystemExit) as exc:
        if debug:
            print_traceback(exc)
        return ConnectorReport(name=name, results=[], load_error=f"the conformance run stopped: {reason(exc)}")


def _run_with_progress(
    console: Console,
    targets: Sequence[str],
    num_checks: int,
    run: Callable[[str, Callable[[CheckResult], None]], ConnectorReport],
) -> list[ConnectorReport]:
    """Run each target, with a live progress bar on a terminal and one line per connector otherwise."""
    if not console.is_terminal:
        reports = []
        for target in targets:
            console.print(f"validating {target} ({num_checks} checks)", markup=False)
            reports.append(run(target, lambda result: None))
        return reports

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        reports = []
        for target in targets:
            task = progress.add_task(target, total=num_checks, last="")

            def advance(result: CheckResult, task: Any = task) -> None:
                progress.update(task, advance=1, last=f"{result.id}: {result.status}")

            reports.append(run(target, advance))
            progress.update(task, completed=num_checks)
    return reports


_STYLE = {"passed": "green", "failed": "bold red", "skipped": "yellow", "not run": "dim"}


def _render(reports: Sequence[ConnectorReport], *, debug_hint: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvconn.testing.conformance.results import NOT_RUN

    from ..output import note, out_console, print_table

    console = out_console()
    for report in reports:
        if report.results:
            # Row lines only when some row has a message (possibly wrapped): they keep the rows apart.
            show_lines = any(r.message for r in report.results)
            table = Table(title=f"kvconn validate {report.name}", title_justify="left", show_lines=show_lines)
            table.add_column("check", no_wrap=True)
            table.add_column("name")
            table.add_column("status", no_wrap=True)
            table.add_column("message", overflow="fold")
            for r in report.results:
                # a check skipped because a check it depends on failed: the root cause is the failure above
                status = "not run" if r.message.startswith(NOT_RUN) else r.status
                style = _STYLE.get(status, "")
                # observed, then how to fix on a line of its own; the "; " stays for plain columns, which join lines
                message = r.message.replace("; fix: ", ";\nfix: ")
                table.add_row(escape(r.id), escape(r.name), f"[{style}]{status}[/]", escape(message))
            print_table(table)
        for line in report.notes:
            console.print(f"[yellow]note:[/] {escape(line)}", soft_wrap=True)
        if report.load_error is not None:
            console.print(
                f"[bold red]{escape(report.name)}: cannot load:[/] {escape(report.load_error)}", soft_wrap=True
            )
            if debug_hint:
                note("  rerun with --debug to see the traceback")
        verdict = "[green]ok[/]" if report.ok else "[bold red]FAILED[/]"
        console.print(
            f"{escape(report.name)}: {verdict}  {report.passed} passed, {report.failed} failed, "
            f"{report.skipped} skipped\n"
        )


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
