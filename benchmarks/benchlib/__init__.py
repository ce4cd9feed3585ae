"""The shared helpers of the benchmark scripts: timing, medians, a table, targets and ``--json``.

The scripts in ``benchmarks/suite/`` (what ``kvconn bench`` runs) and
``benchmarks/studies/`` (one-off measurements) import what they share from
here and nothing from each other; each folder links this package
(``benchlib -> ../benchlib``) so a script run by path finds it. Its modules:
this one (timing, the table, the repository's root), :mod:`benchlib.connectors`
(the connectors that do nothing, as baselines), :mod:`benchlib.scheduler`
(kvconn's reference scheduler in decode), :mod:`benchlib.vllm_engine` (a vLLM
engine on a random Llama, in a process of its own) and
:mod:`benchlib.vllm_step` (vLLM's scheduler stepped with a connector, metered).

Every script measures the things it compares side by side in one process
(ratios survive a noisy, shared machine better than absolute times), prints
a table and its targets, and with ``--json FILE`` writes the same figures
with the machine they came from. ``--quick`` runs tiny sizes: the smoke tests
use it; it measures nothing worth recording.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvconn_cli.rounds import interleaved_rounds

__all__ = [
    "CANNOT_RUN", "REPO", "SOURCES", "Bench", "arg_parser", "machine", "median_times", "mooncake_netns", "parse_args",
    "percentile", "redis_server", "round_times",
]  # fmt: skip

#: The repository's root (the link a script's folder has to this package resolved).
REPO = Path(__file__).resolve().parents[2]
#: Where each distribution of a checkout keeps its sources: put first on ``PYTHONPATH`` (this checkout's, or an
#: earlier one's for a before/after), they shadow the installed packages.
SOURCES = ("sdk/src", "cli/src", "adapters/vllm/src", "plugins/dummy/src", "plugins/offload/src",
           "plugins/mooncake/src", "plugins/redis/src")  # fmt: skip
#: Exit status of a benchmark that cannot run on this machine; it says why on stderr (no vLLM, no root...).
CANNOT_RUN = 2


def arg_parser(description: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser with ``--quick`` (tiny sizes) and ``--json FILE``; the first docstring line is the
    description. A benchmark with options of its own adds them to it."""
    parser = argparse.ArgumentParser(description=(description or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (a smoke run)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON to FILE")
    return parser


def parse_args(description: str | None, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options of :func:`arg_parser`, for a benchmark with none of its own."""
    return arg_parser(description).parse_args(argv)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (0 <= q <= 1), the nearest of them: no interpolation between samples."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median_times(
    *fns: Callable[[], object],
    repeat: int = 7,
    min_time: float = 0.01,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median seconds per call of each of ``fns``, measured side by side (see :func:`round_times`)."""
    return [statistics.median(times) for times in round_times(*fns, repeat=repeat, min_time=min_time, clock=clock)]


def round_times(
    *fns: Callable[[], object],
    repeat: int = 7,
    min_time: float = 0.01,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Seconds per call of each of ``fns`` in each of ``repeat`` rounds, measured side by side.

    Each function is calibrated to enough calls per round to last ``min_time``
    (one batch: reading ``clock`` around every call of a microsecond function
    would time the clock); then the rounds are interleaved, one batch of each
    function per round, the order rotated each round
    (:func:`kvconn_cli.rounds.interleaved_rounds`, the timer of ``kvconn
    simulate`` too), so a slow spell of a shared machine lands on every
    function alike, and round ``i`` of one function can be compared with round
    ``i`` of another. ``clock``: ``time.thread_time`` counts only this
    thread's CPU time, so the time others' processes hold the CPU is left out
    (single-threaded code only).
    """
    numbers = [_calibrate(fn, min_time) for fn in fns]

    def batch(i: int, round_: int, sweep: int) -> float:
        fn, number = fns[i], numbers[i]
        start = clock()
        for _ in range(number):
            fn()
        return (clock() - start) / number

    rounds = interleaved_rounds(batch, len(fns), range(repeat), seconds=float)
    return [[seconds for (seconds,) in run_rounds] for run_rounds in rounds]


def _calibrate(fn: Callable[[], object], min_time: float) -> int:
    """How many calls of ``fn`` last at least ``min_time``."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or number >= 1 << 20:
            return number
        number *= 2 if elapsed <= 0 else max(2, min(10, int(min_time / elapsed) + 1))


def redis_server() -> Any:
    """A throw-away ``redis-server`` (the redis plugin's test helper: 127.0.0.1, a free port, stopped by PID),
    not started yet; ``start()`` raises ``RuntimeError`` without the Debian package."""
    return _test_helper("redis_server", "plugins/redis/tests/redis_server.py").RedisServer()


def mooncake_netns() -> Any:
    """The Mooncake plugin's test harness (``plugins/mooncake/tests/mooncake_netns.py``): a network namespace with
    a real ``mooncake_master`` in it, and why it cannot run here (``netns_unavailable_reason``...)."""
    return _test_helper("mooncake_netns", "plugins/mooncake/tests/mooncake_netns.py")


def _test_helper(name: str, path: str) -> Any:
    """The module at ``path`` (from the repository's root; a plugin's tests are no package), imported once as
    ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def machine() -> dict[str, Any]:
    """Where the figures came from."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1min": round(load[0], 2),
    }


@dataclass
class Bench:
    """A benchmark's table and targets; :meth:`finish` prints them and writes ``--json``."""

    name: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: More figures for ``--json`` (e.g. per-request data), beside the table's.
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self, *values: Any) -> None:
        self.rows.append(list(values))

    def target(self, what: str, ok: bool, measured: str) -> None:
        self.targets.append({"target": what, "met": ok, "measured": measured})

    def finish(self, args: argparse.Namespace) -> int:
        """Print the table and targets; a missed target is reported, not an error (exit 0)."""
        cells = [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(self.columns)]
        print(f"{self.name}{'  (--quick: smoke sizes, not a measurement)' if args.quick else ''}")
        print("  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True)))
        for row in cells:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        for t in self.targets:
            print(f"{'MET ' if t['met'] else 'MISSED'} {t['target']}: {t['measured']}")
        for note in self.notes:
            print(f"note: {note}")
        if args.json is not None:
            doc = {
                "benchmark": self.name,
                "quick": args.quick,
                "machine": machine(),
                "columns": self.columns,
                "rows": self.rows,
                "targets": self.targets,
                "notes": self.notes,
                **self.extra,
            }
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
        return 0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)
