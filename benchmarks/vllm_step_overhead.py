"""kvconn's cost per step inside vLLM's real scheduler, with a connector that does nothing.

What an engine pays for hosting kvconn at all: per decode step, the adapter's
translation of vLLM's ``SchedulerOutput``, the host's dispatch, the metadata
encode, vLLM's pickling of it (its ``MessageQueue``), and the worker side's
decode and per-step hooks, with ``NoOpConnector`` (empty metadata every
step). Measured side by side, in interleaved rounds, against the same vLLM
scheduler without a connector, at 64, 256 and 1024 running requests in
decode. Runs in the vLLM venv (``.venv-vllm/bin/python benchmarks/vllm_step_overhead.py``).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from benchlib import Bench, median_times, parse_args

import kvconn
from kvconn_vllm.harness import (
    make_model_runner_output,
    make_request,
    make_scheduler,
    prepare_environment,
    vllm_import_error,
)

__all__ = ["NoOpConnector", "main"]

PROMPT_TOKENS = 64  # 4 blocks of 16


class NoOpConnector(kvconn.KVConnector):
    """Sends empty metadata every step and does nothing else."""

    def build_connector_meta(self, scheduler_output: Any, block_state: Any) -> kvconn.KVConnectorMetadata:
        return kvconn.KVConnectorMetadata()


def decoding(connector: str | None, running: int) -> Any:
    """vLLM's scheduler with ``running`` requests past their prefill, decoding."""
    scheduler = make_scheduler(
        connector,
        num_blocks=running * 12 + 1,
        max_num_seqs=running,
        max_num_batched_tokens=running * PROMPT_TOKENS,
        max_model_len=2048,
    )
    for i in range(running):
        prompt = [(i * 131 + j) % 30000 + 3 for j in range(PROMPT_TOKENS)]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=1900))
    return scheduler


def step_function(scheduler: Any) -> Any:
    """One engine step: schedule, the worker side's connector calls (if any), update."""
    worker = None
    if scheduler.connector is not None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.outputs import KVConnectorOutput

        from kvconn_vllm import KVConnVllmConnector

        worker = KVConnVllmConnector(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config)

    def step() -> None:
        output = scheduler.schedule()
        kv_output = None
        if worker is not None:
            worker.bind_connector_metadata(pickle.loads(pickle.dumps(output.kv_connector_metadata)))
            worker.wait_for_save()
            results = worker.get_transfer_results(output.finished_req_ids)
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()
        scheduler.update_from_output(output, make_model_runner_output(output, scheduler, kv_connector_output=kv_output))

    step()  # the prefill step
    return step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    prepare_environment()
    if error := vllm_import_error():
        print(f"cannot run: vLLM is not installed here ({error}); use .venv-vllm/bin/python", file=sys.stderr)
        return 2
    sizes = (8, 16) if args.quick else (64, 256, 1024)
    bench = Bench(
        "kvconn's per-step cost inside vLLM's scheduler (no-op connector vs no connector)",
        ["running", "vLLM step us", "with kvconn us", "kvconn us", "kvconn %"],
    )
    noop = f"{__name__ if __name__ != '__main__' else 'vllm_step_overhead'}:NoOpConnector"
    shares: dict[int, float] = {}
    for running in sizes:
        plain, hosted = step_function(decoding(None, running)), step_function(decoding(noop, running))
        base, with_kvconn = median_times(plain, hosted, repeat=3 if args.quick else 9, min_time=0.2)
        shares[running] = (with_kvconn - base) / base * 100
        bench.row(running, base * 1e6, with_kvconn * 1e6, (with_kvconn - base) * 1e6, shares[running])
    at = 256 if 256 in shares else sizes[-1]
    bench.target(f"kvconn adds <= 2% to a decode step at {at} running requests", shares[at] <= 2, f"{shares[at]:.1f}%")
    bench.notes.append("a step: schedule() + the worker's connector calls (pickled metadata) + update_from_output()")
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
