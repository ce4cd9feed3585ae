"""Start-up: ``import kvconn`` and ``kvconn list`` against ``python -c pass``.

Each command runs as a fresh process. With hyperfine on PATH it does the
timing (warm-up runs, then medians); otherwise the commands run in
interleaved rounds (so load noise hits all alike) and the median is taken.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import Bench, parse_args

__all__ = ["main"]

KVCONN = str(Path(sys.executable).parent / "kvconn")
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import kvconn": [sys.executable, "-c", "import kvconn"],
    "kvconn list": [KVCONN, "list"],
}


def _hyperfine(runs: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "hyperfine.json"
        argv = ["hyperfine", "-N", "--warmup", "3", "--runs", str(runs), "--export-json", str(export)]
        for label, cmd in COMMANDS.items():
            argv += ["-n", label, subprocess.list2cmdline(cmd)]
        subprocess.run(argv, check=True, capture_output=True)
        results = json.loads(export.read_text())["results"]
    return {r["command"]: r["median"] for r in results}


def _interleaved(runs: int) -> dict[str, float]:
    times: dict[str, list[float]] = {label: [] for label in COMMANDS}
    for round_ in range(runs + 2):
        for label, cmd in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            if round_ >= 2:  # two warm-up rounds
                times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) for label, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    runs = 3 if args.quick else 30
    tool = "hyperfine" if shutil.which("hyperfine") and not args.quick else "subprocess loop"
    medians = _hyperfine(runs) if tool == "hyperfine" else _interleaved(runs)
    bare = medians["python -c pass"]
    bench = Bench(f"start-up ({tool}, median of {runs} runs)", ["command", "median ms", "over bare python ms"])
    for label, seconds in medians.items():
        bench.row(label, seconds * 1e3, (seconds - bare) * 1e3)
    extra_import = medians["import kvconn"] - bare
    bench.target("import kvconn < 100 ms over bare python", extra_import < 0.1, f"{extra_import * 1e3:.0f} ms")
    bench.target("kvconn list < 500 ms", medians["kvconn list"] < 0.5, f"{medians['kvconn list'] * 1e3:.0f} ms")
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
