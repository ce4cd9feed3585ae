"""``kvconn simulate``: run a workload on the reference engine without and with connectors, side by side.

Exit codes: 0 every run produced exactly the tokens of the run without a
connector, 1 a run's output differs (or a connector cannot be loaded), 2 a
usage error.

Hook failures are not printed as they happen (no tracebacks unless
``KVCONN_DEBUG=1``): after the runs, one line per connector and hook says how
often it failed. With ``--json``, whatever a plugin prints goes to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..rounds import DEFAULT_MIN_ROUND_S, Clock

if TYPE_CHECKING:
    from kvconn.reference.simulate import ConnectorSetup

    from ..measure import MeasuredRun, Simulation

__all__ = [
    "MAX_NUM_BLOCKS",
    "MAX_REQUESTS",
    "MAX_ROUND_SECONDS",
    "MIN_NUM_BLOCKS",
    "WorkloadName",
    "register",
    "setups_from_options",
    "simulate",
]

#: Bounds of --num-blocks: a pool smaller than a block table is useless, a larger one only eats memory
#: (each block holds KV for every layer of the reference model).
MIN_NUM_BLOCKS, MAX_NUM_BLOCKS = 16, 1 << 16
#: Bound of --requests: the workload is built and run in memory, three times and more.
MAX_REQUESTS = 10_000
#: Bound of --round-seconds (per run and round: a simulation lasts about runs x repeats times this).
MAX_ROUND_SECONDS = 600.0


class WorkloadName(str, enum.Enum):
    """The workload shapes of :mod:`kvconn.reference.workloads`."""

    shared_prefix = "shared-prefix"
    multi_turn = "multi-turn"
    long_document = "long-document"


def simulate(
    connectors: Annotated[
        list[str],
        typer.Option(
            "--connector",
            help="A connector to compare (repeat: runs side by side; 'a,b': a and b together in one host).",
        ),
    ],
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help='Connector config as a JSON object; with several connectors, {"name": {...}} per connector.',
        ),
    ] = None,
    config_file: Annotated[Path | None, typer.Option("--config-file", help="Read --config from a JSON file.")] = None,
    workload: Annotated[
        WorkloadName, typer.Option("--workload", help="The workload shape.")
    ] = WorkloadName.shared_prefix,
    requests: Annotated[int, typer.Option("--requests", help=f"Number of requests (1 to {MAX_REQUESTS}).")] = 48,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the workload generator.")] = 0,
    num_blocks: Annotated[
        int,
        typer.Option(
            "--num-blocks",
            help=f"Local (GPU-side) block pool: running requests and the local prefix cache "
            f"({MIN_NUM_BLOCKS} to {MAX_NUM_BLOCKS}, and enough for the workload's longest request).",
        ),
    ] = 256,
    prefix_cache: Annotated[
        bool,
        typer.Option(
            "--prefix-cache/--no-prefix-cache", help="Local prefix caching (off: every hit comes from a connector)."
        ),
    ] = True,
    repeats: Annotated[
        int,
        typer.Option("--repeats", min=1, help="Timed rounds after one warm-up round (steps/s: min / median / max)."),
    ] = 3,
    clock: Annotated[
        Clock,
        typer.Option(
            "--clock",
            help="Time rounds by this process's CPU time (steady when other work holds the cores) or wall time.",
        ),
    ] = "cpu",
    round_seconds: Annotated[
        float,
        typer.Option(
            "--round-seconds",
            min=0.0,
            max=MAX_ROUND_SECONDS,
            help="A timed round repeats the workload until every run has spent this long by --clock (0: one pass).",
        ),
    ] = DEFAULT_MIN_ROUND_S,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as one JSON object on stdout.")] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Draw tokens computed vs loaded and the hit rate to a PNG.")
    ] = None,
) -> None:
    """Run a seeded workload without a connector and with each connector; compare tokens, hits and time.

    Every request's generated tokens must equal those of the run without a connector: a mismatch exits 1.
    """
    import kvconn
    from kvconn.reference.simulate import SIMULATE_SHAPE
    from kvconn.reference.workloads import make_workload

    from ..config_input import read_config
    from ..errors import EXIT_FAILURE, ConnectorFailure, UsageError
    from ..logs import configure_logging, debug_from_env
    from ..measure import simulate as run_simulation
    from ..output import error, note, print_json
    from ..unregistered import not_found

    if plot is not None:
        from ..simulate_plot import require_matplotlib

        if plot.suffix.lower() != ".png":
            raise UsageError(f"--plot writes a PNG: give a file name ending in .png, not {str(plot)!r}")
        require_matplotlib()
    _check_range("--requests", requests, 1, MAX_REQUESTS)
    _check_range("--num-blocks", num_blocks, MIN_NUM_BLOCKS, MAX_NUM_BLOCKS)
    setups = setups_from_options(connectors, read_config(config, config_file))
    shape = SIMULATE_SHAPE.replace(num_blocks=num_blocks, enable_prefix_caching=prefix_cache)
    work = make_workload(workload.value, requests, seed)
    _check_pool_fits(work, shape)
    debug = debug_from_env()
    configure_logging(debug)
    try:
        with _quiet_failures(debug), _stdout_for_data(as_json), _Progress(len(setups) + 1, requests) as progress:
            result = run_simulation(
                work,
                setups,
                shape,
                on_progress=progress.update,
                repeats=repeats,
                clock=clock,
                min_round_s=round_seconds,
            )
    except kvconn.ConnectorNotFoundError as exc:
        raise not_found(exc) from None
    except kvconn.ConnectorConfigError as exc:
        raise UsageError(str(exc)) from None
    except kvconn.KVConnError as exc:
        raise ConnectorFailure(str(exc)) from None
    except SystemExit as exc:  # plugin code calling sys.exit must not end the command with its code, silently
        raise ConnectorFailure(f"a connector called sys.exit({exc.code!r}) during the simulation") from None
    _report_failures(result.runs)
    if plot is not None:
        from ..simulate_plot import plot_simulation

        plot_simulation(result, plot)
        note(f"plot written to {plot}")
    if as_json:
        print_json(result.to_dict())
    else:
        _render(result)
    for run in result.runs:
        if not run.verified:
            error(
                f"{run.label}: output differs from the run without a connector for {len(run.mismatched)} of "
                f"{len(run.outputs)} requests (first: req-{run.mismatched[0]}): the connector loaded wrong KV"
            )
    if not result.verified:
        raise typer.Exit(EXIT_FAILURE)


def _check_range(option: str, value: int, low: int, high: int) -> None:
    from ..errors import UsageError

    if not low <= value <= high:
        raise UsageError(f"{option} must be between {low} and {high}, got {value}")


def _check_pool_fits(work: Any, shape: Any) -> None:
    """Refuse a pool that cannot hold the workload's longest request (it would never be scheduled)."""
    from ..errors import UsageError

    bs = shape.block_size
    longest = max(len(r.prompt) + r.max_tokens - 1 for r in work.requests)
    needed = -(-longest // bs) + 1  # block 0 is the null block
    if shape.num_blocks < needed:
        raise UsageError(
            f"--num-blocks {shape.num_blocks} is too small for this workload: its longest request needs "
            f"{needed - 1} blocks of {bs} tokens ({longest} tokens) plus the null block; "
            f"pass --num-blocks {needed} or more"
        )


@contextlib.contextmanager
def _stdout_for_data(as_json: bool) -> Iterator[None]:
    """With ``--json``, send what plugins print while loading and running to stderr: stdout is for the document."""
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _quiet_failures(debug: bool) -> Iterator[None]:
    """Hold back the host's per-failure log lines (summarised after the runs), unless debugging."""
    host_log = logging.getLogger("kvconn.host")

    def not_a_hook_failure(record: logging.LogRecord) -> bool:
        return not hasattr(record, "kvconn_hook_failure")

    if not debug:
        host_log.addFilter(not_a_hook_failure)
    try:
        yield
    finally:
        host_log.removeFilter(not_a_hook_failure)


def _report_failures(runs: Sequence[MeasuredRun]) -> None:
    """One warning line per (run, connector, hook) that failed: how often, and the first error."""
    from ..output import warn

    for run in runs:
        for failure in run.hook_failures:
            warn(
                f"{run.label}: connector {failure.connector!r} failed in {failure.hook} {failure.count} time(s); "
                f"its work there was dropped (degraded). First error: {failure.first_error}"
            )


def setups_from_options(connectors: Sequence[str], config: dict[str, Any] | None) -> list[ConnectorSetup]:
    """One setup per ``--connector`` value; ``config`` is the one connector's, or ``{name: config}``.

    Raises :class:`~kvconn_cli.errors.UsageError` for an empty name or a
    config that names connectors not given.
    """
    from kvconn.reference.simulate import ConnectorSetup

    from ..errors import UsageError

    runs = [tuple(n.strip() for n in value.split(",")) for value in connectors]
    if any(not n for names in runs for n in names):
        raise UsageError("--connector needs a connector name (or 'a,b' for several in one run), got an empty one")
    distinct = sorted({n for names in runs for n in names})
    if config is None:
        return _distinct_labels([ConnectorSetup(names) for names in runs])
    if len(distinct) == 1:
        per_name = {distinct[0]: config}
    else:
        unknown = sorted(set(config) - set(distinct))
        if unknown or not all(isinstance(v, dict) for v in config.values()):
            raise UsageError(
                f"with several connectors, --config must map connector names to their configs "
                f'(e.g. {{"{distinct[0]}": {{...}}}}); it names {", ".join(unknown) or "non-object values"}, '
                f"and the connectors are: {', '.join(distinct)}"
            )
        per_name = config
    return _distinct_labels(
        [
            ConnectorSetup(
                names, per_name.get(names[0]) if len(names) == 1 else {n: per_name[n] for n in names if n in per_name}
            )
            for names in runs
        ]
    )


def _distinct_labels(setups: list[ConnectorSetup]) -> list[ConnectorSetup]:
    """The same connector given twice is two runs: label the repeats ``dummy #2``, ``dummy #3``..."""
    seen: dict[str, int] = {}
    labelled = []
    for setup in setups:
        seen[setup.label] = count = seen.get(setup.label, 0) + 1
        labelled.append(dataclasses.replace(setup, run_label=f"{setup.label} #{count}") if count > 1 else setup)
    return labelled


class _Progress:
    """A rich progress bar on stderr, one task per run; plain lines when stderr is not a terminal."""

    def __init__(self, num_runs: int, num_requests: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from ..output import err_console

        self._console = err_console()
        self._num_requests = num_requests
        self._progress = Progress(
            TextColumn("[bold]{task.description:<24}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=self._console,
            disable=not self._console.is_terminal,
        )
        self._tasks: dict[str, Any] = {}
        self._num_runs = num_runs

    def __enter__(self) -> _Progress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)

    def update(self, label: str, finished: int, total: int) -> None:
        task = self._tasks.get(label)
        if task is None:
            task = self._tasks[label] = self._progress.add_task(label, total=total)
            if not self._console.is_terminal:
                self._console.print(f"simulating {label} ({len(self._tasks)}/{self._num_runs})", markup=False)
        self._progress.update(task, completed=finished)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _verdict(run: MeasuredRun, baseline: MeasuredRun) -> str:
    if run is baseline:
        return "reference"
    return "[green]yes[/]" if run.verified else f"[bold red]NO ({len(run.mismatched)} requests differ)[/]"


def _render(result: Simulation) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..measure import describe_local_cache
    from ..output import out_console, print_table

    console = out_console()
    w = result.workload
    console.print(f"[bold]workload[/]: {w.name}, {escape(w.description)}, seed {w.seed}")
    reusable = result.reusable_tokens / w.num_prompt_tokens if w.num_prompt_tokens else 0.0
    console.print(
        f"  {w.num_prompt_tokens} prompt tokens, of which {result.reusable_tokens} ({reusable:.0%}) are "
        "a whole-block prefix of an earlier prompt (the most any cache can save)"
    )
    console.print(f"[bold]engine[/]: reference engine, {escape(describe_local_cache(result.shape))}")
    runs = [result.baseline, *result.runs]
    table = Table(title="kvconn simulate", title_justify="left")
    table.add_column("")
    for run in runs:
        table.add_column(escape(run.label), justify="right")
    rows: list[tuple[str, Any]] = [
        ("prompt tokens computed", lambda r: f"{r.stats.prompt_tokens_computed:,}"),
        ("prompt tokens from local cache", lambda r: f"{r.stats.prompt_tokens_cached:,}"),
        ("prompt tokens loaded (connector)", lambda r: f"{r.stats.prompt_tokens_loaded:,}"),
        ("connector hit rate", lambda r: f"{r.hit_rate:.1%}"),
        ("blocks saved / loaded", lambda r: f"{r.stats.blocks_saved:,} / {r.stats.blocks_loaded:,}"),
        ("bytes saved / loaded", lambda r: f"{_bytes(r.stats.bytes_saved)} / {_bytes(r.stats.bytes_loaded)}"),
        ("steps", lambda r: f"{r.steps:,}"),
        (
            f"steps/s by {result.timing.clock} time (min / median / max)",
            lambda r: f"{r.steps_per_s_min:,.0f} / {r.steps_per_s:,.0f} / {r.steps_per_s_max:,.0f}",
        ),
        ("spread around the median", lambda r: "{:+.0%} / {:+.0%}".format(*r.steps_per_s_spread)),
        (
            "steps/s vs no connector (median round)",
            lambda r: "1.00" if r is result.baseline else f"{result.relative_steps_per_s(r):.2f}",
        ),
        *(
            [("steps/s by wall time (median)", lambda r: f"{r.steps_per_s_wall:,.0f}")]
            if result.timing.clock != "wall"
            else []
        ),
        ("connector time / step (median)", lambda r: f"{r.connector_ms_per_step:.2f} ms"),
        ("preemptions", lambda r: str(r.stats.preemptions)),
        ("degraded events (every pass)", lambda r: f"{r.stats.degraded_events:,}"),
        ("failed load blocks (every pass)", lambda r: f"{r.stats.failed_load_blocks:,}"),
        ("output verified", lambda r: _verdict(r, result.baseline)),
    ]
    for name, cell in rows:
        table.add_row(name, *(cell(run) for run in runs))
    print_table(table)
    console.print(
        "connector time: wall time inside the ConnectorHost calls of scheduler and worker (SDK dispatch and the "
        "connectors' hook code, including synchronous copies); steps/s: whole engine steps on this machine. "
        "Faults (every pass) are summed over every pass of every round, the warm-up's included; the other "
        f"counts are one pass's. Times: {escape(result.timing.describe())}.",
        style="dim",
    )


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
