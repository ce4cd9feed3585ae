"""Block state per step: the lazy state against the eager snapshot and the floor.

What the scheduler pays each step to offer block tables to connectors:

* floor: ``set(num_scheduled_tokens)``, the offered set alone;
* lazy: ``KVConnectorBlockState(set(num_scheduled_tokens), resolver)``, what
  kvconn does (tables are resolved only for requests a connector reads, a
  cost that is the same in any design);
* eager: the old design, a dict copying every scheduled request's table.

The resolver builds fresh lists as the KV cache manager's ``get_block_ids`` does.
All three are timed as the same kind of call (a function of the scheduled
dict and the resolver), so the harness costs the same in each.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

from benchlib import Bench, median_times, parse_args

from kvconn import BlockIds, KVConnectorBlockState

__all__ = ["main"]


def _fixture(num_requests: int, num_blocks: int) -> tuple[dict[str, int], Callable[[str], BlockIds]]:
    table = list(range(1, num_blocks + 1))  # one table shared by all requests: memory stays small
    tables = {f"req-{i}": table for i in range(num_requests)}

    def resolve(req_id: str) -> BlockIds:
        return (list(tables[req_id]),)

    return dict.fromkeys(tables, 1), resolve


def _floor(scheduled: dict[str, int], resolve: Callable[[str], BlockIds]) -> set[str]:
    return set(scheduled)


def _lazy(scheduled: dict[str, int], resolve: Callable[[str], BlockIds]) -> KVConnectorBlockState:
    return KVConnectorBlockState(set(scheduled), resolve)


def _eager(scheduled: dict[str, int], resolve: Callable[[str], BlockIds]) -> dict[str, BlockIds]:
    return {req_id: resolve(req_id) for req_id in scheduled}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    requests = (64, 256) if args.quick else (64, 256, 1024, 4096)
    blocks = (16, 128) if args.quick else (16, 128, 1024)
    repeat = 3 if args.quick else 7
    bench = Bench(
        "block state per step",
        ["requests", "blocks", "floor us", "lazy us", "eager us", "lazy/floor", "eager/lazy"],
    )
    worst_lazy, ratio_1024x128 = 0.0, None
    for n in requests:
        for b in blocks:
            scheduled, resolve = _fixture(n, b)
            floor, lazy, eager = median_times(
                *(partial(fn, scheduled, resolve) for fn in (_floor, _lazy, _eager)), repeat=repeat
            )
            bench.row(n, b, floor * 1e6, lazy * 1e6, eager * 1e6, lazy / floor, eager / lazy)
            worst_lazy = max(worst_lazy, lazy / floor)
            if (n, b) == (1024, 128):
                ratio_1024x128 = eager / lazy
    bench.target("lazy within 2x of the floor at every size", worst_lazy <= 2.0, f"worst {worst_lazy:.2f}x")
    if ratio_1024x128 is not None:
        bench.target(
            "eager >= 20x the lazy cost at 1024 requests x 128 blocks", ratio_1024x128 >= 20, f"{ratio_1024x128:.0f}x"
        )
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
