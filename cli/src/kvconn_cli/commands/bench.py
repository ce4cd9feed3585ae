"""``kvconn bench NAME``: run one of the repository's benchmark scripts (``benchmarks/suite/*.py``).

Each name maps to a script of the suite (``benchmarks/studies/`` holds the
one-off measurements, run by path); the script prints its table and targets,
and writes JSON with ``--json FILE``. Options after NAME that ``kvconn bench``
does not know are passed to the script. The scripts live in the source
checkout, not in the installed package: they are found in ``--dir``,
``$KVCONN_BENCHMARKS``, ``./benchmarks`` or the checkout this CLI is installed
from (an editable install), in that order.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["BENCHMARKS", "bench", "find_benchmarks_dir", "register"]

#: Benchmark name -> script, relative to the benchmarks directory.
BENCHMARKS = {
    "block-state": "suite/block_state.py",
    "wire": "suite/wire.py",
    "host-dispatch": "suite/host_dispatch.py",
    "scheduler-scaling": "suite/scheduler_scaling.py",
    "startup": "suite/startup.py",
    "connector-scaling": "suite/connector_scaling.py",
    "offload": "suite/offload_bandwidth.py",
    "mooncake": "suite/mooncake_throughput.py",
    "vllm-e2e": "suite/vllm_e2e.py",
    "sglang": "suite/sglang_tier.py",
}


def find_benchmarks_dir(explicit: Path | None) -> Path:
    """The directory holding the benchmark scripts; :class:`UsageError` saying where it looked."""
    from ..errors import UsageError

    candidates = [explicit] if explicit is not None else []
    if explicit is None:
        if os.environ.get("KVCONN_BENCHMARKS"):
            candidates.append(Path(os.environ["KVCONN_BENCHMARKS"]))
        candidates += [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[4] / "benchmarks"]
    for candidate in candidates:
        if (candidate / "benchlib" / "__init__.py").is_file():
            return candidate
    raise UsageError(
        f"no benchmark scripts found (looked in {', '.join(str(c) for c in candidates)}); "
        "run from the kvconn checkout or pass --dir PATH/benchmarks"
    )


def bench(
    ctx: typer.Context,
    name: Annotated[
        str | None, typer.Argument(help=f"The benchmark: {', '.join(BENCHMARKS)}. Omit to list them.")
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="Tiny sizes: a smoke run, not a measurement.")] = False,
    json_file: Annotated[
        Path | None, typer.Option("--json", help="Also write the results as JSON to this file.")
    ] = None,
    directory: Annotated[Path | None, typer.Option("--dir", help="The benchmarks directory (default: found).")] = None,
) -> None:
    """Run a benchmark script: it prints a table and its targets (ratios measured side by side in one run)."""
    from ..errors import UsageError
    from ..output import child_stdout, out_console

    where = find_benchmarks_dir(directory)
    if name is None:
        console = out_console()
        for bench_name, file_name in BENCHMARKS.items():
            present = "" if (where / file_name).is_file() else "  (script not present)"
            console.print(f"{bench_name:18} {where / file_name}{present}", markup=False, highlight=False)
        return
    if name not in BENCHMARKS:
        raise UsageError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    script = where / BENCHMARKS[name]
    if not script.is_file():
        raise UsageError(f"benchmark {name!r} has no script yet: {script} does not exist")
    argv = [sys.executable, str(script), *(["--quick"] if quick else []), *ctx.args]
    if json_file is not None:
        argv += ["--json", str(json_file)]
    code = subprocess.run(argv, check=False, stdout=child_stdout()).returncode
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(bench)
