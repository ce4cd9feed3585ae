"""Scheduler-side connector cost per step: the dummy and the `kvconn new` template against the eager pattern.

What a connector's scheduler side costs an engine step, at a fixed number of
running (decoding) requests, as the blocks each request holds grow:

* eager: the pattern the dummy used to show, resolving every scheduled
  request's table each step and shipping whole tables in its metadata;
* dummy: ``plugins/dummy`` (resolves only the requests whose tokens fill a
  block this step, ships only the filled blocks);
* template: what ``kvconn new`` generates (the same pattern, with block hashes).

One timed unit is a fresh connector, ``update_state_after_alloc`` for every
request, then ``block_size`` decode steps (``build_connector_meta`` and the
msgpack encoding of its metadata), in which each request fills exactly one
block; the figure is that unit per step. Two resolvers: ``copy`` builds fresh
lists as the reference KV cache manager's ``get_block_ids`` does (each table
resolved costs its length, an engine cost every design pays for the tables it
reads), ``live`` hands out the live lists (the connector's own cost alone).
The target: with ``live``, the dummy and the template cost about the same at
1024 blocks per request as at 16; with ``copy`` they pay one table copy per
filled block (every ``block_size`` steps), the eager pattern one per step.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from benchlib import Bench, median_times, parse_args

from kvconn import (
    BlockIds,
    ConnectorContext,
    KVConnectorBlockState,
    KVConnectorRole,
    SchedulerOutput,
)
from kvconn.introspection import hook_object
from kvconn.outputs import CachedRequestData
from kvconn_dummy import DummyConnector, DummyMetadata

__all__ = ["main"]

BLOCK_SIZE = 16
CONTEXT = ConnectorContext(block_size=BLOCK_SIZE)


class EagerDummy(DummyConnector):
    """The old dummy: every scheduled request's whole table, every step."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState) -> Any:
        tables = {r: block_state.get_block_ids(r) for r in scheduler_output.num_scheduled_tokens}
        return DummyMetadata(block_ids_by_req={r: t for r, t in tables.items() if t is not None})


@dataclass
class _Request:
    request_id: str
    num_computed_tokens: int
    block_hashes: list[bytes]


def _template_class() -> type:
    """The connector class ``kvconn new bench`` generates, imported from a temporary directory."""
    from kvconn_cli.scaffold import Scaffold, plan

    root = Path(tempfile.mkdtemp(prefix="kvconn-bench-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)  # imported from it until the process ends
    for path, text in plan(Scaffold.for_name("bench"), root).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    sys.path.insert(0, str(root / "src"))
    return importlib.import_module("kvconn_bench").BenchConnector  # type: ignore[no-any-return]


def _workload(
    num_requests: int, num_blocks: int, copy: bool
) -> tuple[list[_Request], list[SchedulerOutput], Callable[[str], BlockIds]]:
    """Decoding requests holding ``num_blocks`` blocks each, and ``BLOCK_SIZE`` steps in which each fills one."""
    table = list(range(1, num_blocks + 1))  # one table shared by all requests: memory stays small
    hashes = [i.to_bytes(32, "little") for i in range(num_blocks)]
    requests = [
        _Request(f"req-{i}", (num_blocks - 2) * BLOCK_SIZE + i % BLOCK_SIZE, hashes) for i in range(num_requests)
    ]
    ids = [r.request_id for r in requests]
    outputs = [
        SchedulerOutput(
            step=k,
            scheduled_new_reqs=[],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=ids, num_computed_tokens=[r.num_computed_tokens + k for r in requests]
            ),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=num_requests,
        )
        for k in range(BLOCK_SIZE)
    ]

    def resolve(req_id: str) -> BlockIds:
        return (list(table) if copy else table,)

    return requests, outputs, resolve


def _unit(
    cls: type, requests: list[_Request], outputs: list[SchedulerOutput], resolve: Callable[[str], BlockIds]
) -> int:
    connector: Any = hook_object(cls(role=KVConnectorRole.SCHEDULER, context=CONTEXT))  # its scheduler side, if any
    # Hooks take any subset of their arguments, by name (as the host calls them).
    wanted = inspect.signature(connector.update_state_after_alloc).parameters
    table = resolve(requests[0].request_id)
    for request in requests:
        arguments = {"request": request, "block_ids": table, "num_external_tokens": 0}
        connector.update_state_after_alloc(**{k: v for k, v in arguments.items() if k in wanted})
    size = 0
    for output in outputs:
        state = KVConnectorBlockState(set(output.num_scheduled_tokens), resolve)
        size += len(msgspec.msgpack.encode(connector.build_connector_meta(output, state)))
    return size


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    requests_sizes = (64,) if args.quick else (256,)
    blocks = (16, 128) if args.quick else (16, 128, 1024)
    repeat = 3 if args.quick else 7
    classes = {"eager": EagerDummy, "dummy": DummyConnector, "template": _template_class()}
    bench = Bench(
        "connector scheduler side per step",
        [
            "resolver",
            "requests",
            "blocks",
            *(f"{name} us" for name in classes),
            *(f"{name} KiB/step" for name in classes),
        ],
    )
    per_step: dict[tuple[str, str, int], float] = {}
    for resolver in ("live", "copy"):
        for n in requests_sizes:
            for b in blocks:
                workload = _workload(n, b, copy=resolver == "copy")
                fns = [partial(_unit, cls, *workload) for cls in classes.values()]
                times = median_times(*fns, repeat=repeat)
                sizes = [fn() / BLOCK_SIZE / 1024 for fn in fns]
                for name, t in zip(classes, times, strict=True):
                    per_step[resolver, name, b] = t / BLOCK_SIZE
                bench.row(resolver, n, b, *(t / BLOCK_SIZE * 1e6 for t in times), *sizes)
    low, high = blocks[0], blocks[-1]
    for resolver in ("live", "copy"):
        for name in classes:
            growth = per_step[resolver, name, high] / per_step[resolver, name, low]
            what = f"{name}, {resolver} resolver: {growth:.2f}x from {low} to {high} blocks per request"
            if resolver == "live" and name != "eager":
                bench.target(f"{name} within 1.5x from {low} to {high} blocks (live resolver)", growth <= 1.5, what)
            else:
                bench.notes.append(what)
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
