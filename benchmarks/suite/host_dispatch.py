"""Host dispatch: one step's connector calls through ``ConnectorHost`` against calling the connectors directly.

The connectors do nothing in their hooks, so the difference is the host's own
cost: routing, error containment and load bookkeeping. One step of calls is
what an engine makes at 256 running requests with 4 arriving and 4 finishing:
``get_num_new_matched_tokens`` + ``update_state_after_alloc`` per arrival,
``request_finished`` per finish, ``build_connector_meta``,
``update_connector_output``; on the worker ``start_load_kv``, per layer
``wait_for_layer_load`` + ``save_kv_layer``, ``wait_for_save``, ``get_finished``.
The target compares the host's extra cost with a reference scheduler step
(schedule + update) at 256 running requests, measured in the same run.
"""

from __future__ import annotations

import sys
from functools import partial

from benchlib import Bench, median_times, parse_args
from benchlib.connectors import EveryHookConnector
from benchlib.scheduler import decode_scheduler, decode_step_seconds

from kvconn import (
    CachedRequestData,
    ConnectorHost,
    KVConnectorBlockState,
    KVConnectorOutput,
    KVConnectorRole,
    SchedulerOutput,
)
from kvconn.testing import create_requests

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    running, layers = (16, 4) if args.quick else (256, 32)
    repeat = 3 if args.quick else 9
    arrivals = create_requests(4, 256, max_tokens=8)
    table = ([1, 2, 3],)
    state = KVConnectorBlockState(set(), lambda r: table)
    output = SchedulerOutput(0, [], CachedRequestData(), {}, 0)
    layer_names = [f"layer.{i}" for i in range(layers)]

    def via_host(sched: ConnectorHost, worker: ConnectorHost) -> None:
        for r in arrivals:
            plan = sched.get_num_new_matched_tokens(r, 0)
            sched.update_state_after_alloc(r, table, plan)
        for r in arrivals:
            sched.request_finished(r, table)
        meta = sched.build_connector_meta(output, state)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        for name in layer_names:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, None)
        worker.wait_for_save()
        sched.update_connector_output(worker.get_finished(set()))

    def direct(connectors: list[EveryHookConnector]) -> None:
        for r in arrivals:
            for c in connectors:
                c.get_num_new_matched_tokens(r, 0)
            for c in connectors:
                c.update_state_after_alloc(r, table, 0)
        for r in arrivals:
            for c in connectors:
                c.request_finished(r, table)
        metas = [c.build_connector_meta(output, state) for c in connectors]
        for c, m in zip(connectors, metas, strict=True):
            c.start_load_kv(m)
        for name in layer_names:
            for c in connectors:
                c.wait_for_layer_load(name)
            for c, m in zip(connectors, metas, strict=True):
                c.save_kv_layer(name, None, m)
        for c in connectors:
            c.wait_for_save()
        for c in connectors:
            c.get_finished(set())
            c.update_connector_output(KVConnectorOutput())

    step_s = min(decode_step_seconds(decode_scheduler(running, 1024), 8 if args.quick else 32) for _ in range(3))
    bench = Bench(
        f"host dispatch: one step's hook calls ({layers} layers) vs a scheduler step at {running} running requests",
        ["connectors", "direct us", "host us", "host extra us", "extra / sched step"],
    )
    worst = 0.0
    for n in (1, 2, 4):
        connectors = [EveryHookConnector() for _ in range(n)]
        hosts = [
            ConnectorHost([(f"c{i}", c) for i, c in enumerate(connectors)], role=role)
            for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        ]
        host_s, direct_s = median_times(partial(via_host, *hosts), partial(direct, connectors), repeat=repeat)
        extra = max(0.0, host_s - direct_s)
        worst = max(worst, extra / step_s)
        bench.row(n, direct_s * 1e6, host_s * 1e6, extra * 1e6, f"{extra / step_s:.1%}")
    bench.notes.append(f"reference scheduler step at {running} running requests: {step_s * 1e6:.0f} us")
    bench.target(f"host extra cost < 5% of a scheduler step at {running} running requests", worst < 0.05,
                 f"worst {worst:.1%} (4 connectors)")  # fmt: skip
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
