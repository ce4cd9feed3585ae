"""Wall time of ``kvconn validate``: this tree against another checkout, rounds interleaved, ratios per round.

``--baseline DIR`` names a checkout of kvconn (a ``git worktree`` of an older
commit): its sources go first on ``PYTHONPATH``, so the same interpreter and
the same installed dependencies run the older code. Each round runs both
trees' ``kvconn validate`` once, in alternating order, as subprocesses; the
table gives each round's seconds and the ratio, and the target is the median
ratio (issue 45: the data checks within 1.5x of before). ``--python`` runs
another venv's interpreter (``.venv-vllm/bin/python`` for ``--engine vllm``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import SOURCES, Bench, arg_parser


def _validate(python: str, args: list[str], checkout: Path | None) -> float:
    """Seconds of one ``kvconn validate`` run; ``checkout``'s sources shadow the installed ones."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(checkout / s) for s in SOURCES)
    start = time.perf_counter()
    proc = subprocess.run([python, "-m", "kvconn_cli", "validate", *args], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # 1: a check failed, still a full run
        raise SystemExit(f"kvconn validate {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--baseline", type=Path, help="a checkout of the tree to compare with")
    parser.add_argument("--connector", default="offload")
    parser.add_argument("--engine", default="reference", choices=("reference", "vllm"))
    parser.add_argument("--check", default="KV04*", help="which checks (default: the data checks)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs kvconn")
    args = parser.parse_args()
    connector, check = ("dummy", "KV00*") if args.quick else (args.connector, args.check)
    validate = [connector, "--engine", args.engine, "--check", check]
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.baseline is not None:
        trees.append(("baseline", args.baseline.resolve()))
    bench = Bench(f"kvconn validate {' '.join(validate)}", ["round", *(t for t, _ in trees), "ratio"])
    ratios = []
    for round_ in range(1 if args.quick else args.rounds):
        order = trees if round_ % 2 == 0 else trees[::-1]
        seconds = {name: _validate(args.python, validate, checkout) for name, checkout in order}
        ratio = seconds["this tree"] / seconds["baseline"] if "baseline" in seconds else 1.0
        ratios.append(ratio)
        bench.row(round_, *(seconds[name] for name, _ in trees), ratio)
    if args.baseline is not None:
        median = statistics.median(ratios)
        bench.target("this tree's wall time <= 1.5x the baseline's (median of rounds)", median <= 1.5, f"{median:.2f}x")
    return bench.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
