"""Scheduler scaling: reference scheduler step cost as running requests and context lengths grow.

A decode step schedules one token per running request. Its cost must grow
with the number of scheduled requests, not with the total number of blocks
the running requests hold: at a fixed number of requests, 16x longer contexts
(16x the blocks) should cost about the same per step.

One step here is ``Scheduler.schedule()`` + ``update_from_output()`` with a
model runner output made without a model (no worker, no connector), averaged
over 32 steps so that the steps which allocate a block are counted.
"""

from __future__ import annotations

import sys

from benchlib import Bench, parse_args
from benchlib.scheduler import decode_scheduler, decode_step_seconds

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    base_running, base_context = (16, 256) if args.quick else (256, 1024)
    running_sizes = (16, 32) if args.quick else (64, 256, 1024)
    context_sizes = (256, 1024) if args.quick else (1024, 4096, 16384)
    repeat = 1 if args.quick else 3
    steps = 8 if args.quick else 32
    bench = Bench(
        "scheduler scaling (decode step: schedule + update_from_output)",
        ["running", "context", "blocks held", "step us", "us/request"],
    )
    grid = list(dict.fromkeys([(r, base_context) for r in running_sizes] + [(base_running, c) for c in context_sizes]))
    times: dict[tuple[int, int], list[float]] = {point: [] for point in grid}
    held: dict[tuple[int, int], int] = {}
    for _ in range(repeat):  # interleaved rounds: a slow spell of the shared machine lands on every size alike
        for running, context in grid:
            scheduler = decode_scheduler(running, context)
            times[(running, context)].append(decode_step_seconds(scheduler, steps))
            kv = scheduler.kv_cache_manager
            held[(running, context)] = sum(len(table) for r in scheduler.requests for table in kv.get_block_ids(r))
    per_request: dict[tuple[int, int], float] = {}
    for running, context in grid:
        step = min(times[(running, context)])
        per_request[(running, context)] = step / running
        bench.row(running, context, held[(running, context)], step * 1e6, step / running * 1e6)

    def flat(what: str, growth: float) -> None:
        bench.target(what, growth < 1.5, f"{growth:.2f}x the per-request cost")

    short, long_ = context_sizes[0], context_sizes[-1]
    flat(
        f"step cost independent of blocks held ({long_ // short}x context at {base_running} requests)",
        per_request[(base_running, long_)] / per_request[(base_running, short)],
    )
    small, large = running_sizes[0], running_sizes[-1]
    flat(
        f"step cost grows with scheduled requests ({large // small}x requests: per-request cost stays flat)",
        per_request[(large, base_context)] / per_request[(small, base_context)],
    )
    bench.notes.append(f"minimum over {repeat} interleaved rounds of the mean step time over {steps} decode steps")
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
