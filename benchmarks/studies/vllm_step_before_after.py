"""kvconn's per-step cost inside vLLM's scheduler: an earlier tree against this one, side by side in one process.

Two runs of ``vllm_step_overhead.py`` on two trees differ by more than a change
of a few microseconds: this machine's speed drifts by a third from one run to
the next. So this script imports the earlier tree's ``kvconn`` and
``kvconn_vllm`` under other names (``kvconn_before``, ``kvconn_vllm_before``:
their sources from ``git archive REV``, with their absolute imports renamed)
and meters both adapters and the bare vLLM connector in the same interleaved
rounds (:func:`benchlib.vllm_step.metered_rounds`), each adapter hosting the
no-op connector (:mod:`benchlib.connectors`) against its own tree. It prints, per step, the time
inside each one's calls, the difference, and where each microsecond went.
Runs in the vLLM venv, from a git checkout::

    .venv-vllm/bin/python benchmarks/studies/vllm_step_before_after.py fc7f3aa

Without a revision it compares the working tree with ``HEAD`` (what an uncommitted change does).
"""

from __future__ import annotations

import io
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchlib import CANNOT_RUN, REPO, Bench, arg_parser, round_times
from benchlib import connectors as this_tree
from benchlib.connectors import bare_connector_class
from benchlib.vllm_step import NOOP, Load, Meter, hosted, metered_rounds, step_function

from kvconn_vllm.testing.harness import prepare_environment, vllm_import_error

__all__ = ["difference", "import_tree", "main"]

#: The packages taken from the earlier tree: their source folder, and the name they are imported under.
PACKAGES = {"kvconn": "sdk/src/kvconn", "kvconn_vllm": "adapters/vllm/src/kvconn_vllm"}
_IMPORT = re.compile(r"\b(from|import) (kvconn|kvconn_vllm)\b(?=[.\s])")
#: What the earlier tree's adapter hosts instead of :data:`NOOP`: the same connector against its own ``kvconn``.
BEFORE_CONFIG = {"kvconn_connector": "noop_before:NoOpConnector"}


def import_tree(rev: str, into: Path) -> type:
    """The adapter class of tree ``rev``, with its ``kvconn`` as ``kvconn_before`` (``into``: a scratch folder).

    Also writes ``noop_before.py`` there: :mod:`benchlib.connectors` against that tree's ``kvconn``.
    """
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, *PACKAGES.values()], capture_output=True, check=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into / "tree", filter="data")
    for name, folder in PACKAGES.items():
        (into / "tree" / folder).rename(into / f"{name}_before")
    sources = {source: source.read_text() for source in into.glob("*_before/**/*.py")}
    sources[into / "noop_before.py"] = Path(this_tree.__file__).read_text()
    for source, text in sources.items():
        source.write_text(_IMPORT.sub(r"\1 \2_before", text))
    sys.path.insert(0, str(into))
    from kvconn_vllm_before.connector import KVConnVllmConnector  # type: ignore[import-not-found]

    return KVConnVllmConnector  # type: ignore[no-any-return]


def difference(first: list[float], second: list[float]) -> float:
    """The median of the round-by-round differences (round ``i`` of each ran back to back)."""
    return statistics.median(a - b for a, b in zip(first, second, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument(
        "rev", nargs="?", default="HEAD", help="the earlier tree, a git revision of this repository (default: HEAD)"
    )
    parser.add_argument("--cpu", action="store_true", help="meter this thread's CPU time (default: wall time)")
    args = parser.parse_args(argv)
    prepare_environment()
    if error := vllm_import_error():
        print(f"cannot run: vLLM is not installed here ({error}); use .venv-vllm/bin/python", file=sys.stderr)
        return CANNOT_RUN
    sizes, rounds = ((8, 16), 3) if args.quick else ((64, 256), 31)
    clock = time.thread_time if args.cpu else time.perf_counter
    bench = Bench(
        f"kvconn's calls per step inside vLLM's scheduler, {args.rev} (before) and this tree (after) side by side, "
        f"{'CPU' if args.cpu else 'wall'} time",
        ["running", "vLLM step us", "bare us", "before us", "after us", "after - before us", "before over bare %",
         "after over bare %"],
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        try:
            adapter = import_tree(args.rev, Path(scratch))
        except subprocess.CalledProcessError as exc:
            why = exc.stderr.decode(errors="replace").strip()
            print(
                f"cannot run: git cannot give the tree {args.rev!r} ({why}); run it in a git checkout", file=sys.stderr
            )
            return CANNOT_RUN
        bare = bare_connector_class()
        for running in sizes:
            meters = {who: Meter(clock) for who in ("bare", "before", "after")}
            steps = {
                "bare": hosted(NOOP, running, adapter=bare, meter=meters["bare"]),
                "before": hosted(NOOP, running, adapter=adapter, extra=BEFORE_CONFIG, meter=meters["before"]),
                "after": hosted(NOOP, running, meter=meters["after"]),
            }
            plain = step_function(Load(None, running))
            # Steady state for every scheduler alike, and the plain step's CPU time.
            times = round_times(plain, *steps.values(), repeat=5, min_time=0.1, clock=time.thread_time)
            base = statistics.median(times[0])
            per_round = max(3, int(0.1 / statistics.median(times[-1])))
            metered = metered_rounds([(steps[w], meters[w]) for w in steps], rounds, per_round)
            results = dict(zip(steps, metered, strict=True))
            inside = {who: per_step for who, (per_step, _, _) in results.items()}

            bench.row(
                running, base * 1e6, *(statistics.median(inside[w]) * 1e6 for w in steps),
                difference(inside["after"], inside["before"]) * 1e6,
                difference(inside["before"], inside["bare"]) / base * 100,
                difference(inside["after"], inside["bare"]) / base * 100,
            )  # fmt: skip
            for who, (_, _, by_call) in results.items():
                bench.notes.append(
                    f"at {running} running, {who}, us per step: "
                    + ", ".join(f"{call} {s * 1e6:.1f}" for call, s in by_call.most_common())
                )
    bench.notes.append(
        "'us': time inside each connector's calls per step, and the metadata's pickle round trip (medians of "
        f"{rounds} interleaved rounds); 'after - before' and 'over bare': round by round, medians; the meter's own "
        "cost is in every figure alike; '%': over the plain step's CPU time (vLLM without a connector)"
    )
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
