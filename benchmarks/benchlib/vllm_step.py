"""vLLM's real scheduler stepped under a steady load, its connector's calls metered: kvconn's cost per step.

``vllm_step_overhead.py`` sets kvconn's adapter hosting the do-nothing
connector against no connector and against a bare vLLM connector;
``vllm_step_before_after.py`` sets two trees' adapters side by side. Needs
vLLM (the vLLM venv); importing this module does not.
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvconn_vllm.testing.harness import make_model_runner_output, make_request, make_scheduler

__all__ = [
    "NOOP", "SCHEDULER_CALLS", "WORKER_CALLS", "Load", "Meter", "hosted", "metered_rounds", "roundtrip",
    "step_function",
]  # fmt: skip

#: The do-nothing connector, as kvconn's adapter loads it (by path: ``benchlib`` is beside the script).
NOOP = "benchlib.connectors:NoOpConnector"
PROMPT_TOKENS = 64  # 4 blocks of 16
MAX_OUTPUT = 768  # requests generate 256..MAX_OUTPUT tokens, staggered


class Load:
    """``running`` requests in vLLM's scheduler, kept at that number: a finished one is replaced."""

    def __init__(self, connector: str | None, running: int) -> None:
        self.running, self.added = running, 0
        blocks_per_request = -(-(PROMPT_TOKENS + MAX_OUTPUT) // 16) + 1
        self.scheduler = make_scheduler(
            connector,
            num_blocks=running * blocks_per_request + 1,
            max_num_seqs=running,
            max_num_batched_tokens=max(running * 2, PROMPT_TOKENS * 4),
            max_model_len=2048,
        )
        self.refill()

    def refill(self) -> None:
        while self.scheduler.get_num_unfinished_requests() < self.running:
            i = self.added
            self.added += 1
            prompt = [(i * 131 + j) % 30000 + 3 for j in range(PROMPT_TOKENS)]
            max_tokens = 256 + (i * 389) % (MAX_OUTPUT - 255)
            self.scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))


#: What vLLM's scheduler calls on a connector: the adapter's scheduler-side entry points, timed by a :class:`Meter`.
SCHEDULER_CALLS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "request_finished_all_groups", "update_connector_output",
)  # fmt: skip


#: What vLLM's model runner calls on the worker side in a step, in its order (see :func:`step_function`).
WORKER_CALLS = (
    "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors", "get_kv_connector_stats", "build_connector_worker_meta",
    "clear_connector_metadata",
)  # fmt: skip


class Meter:
    """Seconds spent in a connector, over all steps: the direct measure of what kvconn adds.

    It does not depend on telling two noisy vLLM step times apart. Each entry
    point vLLM calls is timed as a whole (nested calls, such as
    ``request_finished`` calling ``request_finished_all_groups``, are counted
    once in :attr:`seconds`, and in :attr:`by_call` under each name), and so is
    the metadata's pickle round trip (see :func:`step_function`). The clock
    reads are counted too, so the figure errs high (:meth:`overhead` says by
    how much). ``clock``: wall time by default; ``time.thread_time`` leaves out
    the time the CPU spends on other processes, at ~0.2 us a read.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds = 0.0
        #: seconds and calls per entry point (where each microsecond goes)
        self.by_call: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._depth = 0

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            if hasattr(obj, name):  # the bare connector has no request_finished_all_groups (no SupportsHMA)
                setattr(obj, name, self.timed(getattr(obj, name), name))

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self.clock() - start
                self._depth -= 1
                self.by_call[name] += elapsed
                self.calls[name] += 1
                if not self._depth:
                    self.seconds += elapsed

        return call

    def overhead(self, calls: int = 20000) -> float:
        """Seconds this meter counts for one call of a function that does nothing (its clock reads, its frame)."""
        meter = Meter(self.clock)
        nothing = meter.timed(lambda: None, "nothing")
        for _ in range(calls):
            nothing()
        return meter.seconds / calls


def roundtrip(obj: Any) -> Any:
    """``obj`` after the trip through vLLM's ``MessageQueue`` (pickle)."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def step_function(load: Load, worker: Any = None, meter: Meter | None = None) -> Callable[[], None]:
    """One engine step: schedule, the worker side's connector calls (if any), update, refill.

    What crosses processes is pickled, as vLLM's multiprocess executor does:
    the connector metadata to the workers and their connector output back.
    The worker's calls run back to back, as in vLLM's model runner; with a
    ``meter`` each is timed, and so is the metadata's round trip (a
    standalone ``pickle`` round trip: more than the metadata's share of vLLM's
    pickling of the whole output). The trip back is vLLM's own
    ``KVConnectorOutput`` (the bare connector's too), which carries kvconn's
    report only when there is one; it is not metered.
    """
    from vllm.v1.outputs import KVConnectorOutput

    scheduler = load.scheduler
    send = roundtrip
    if meter is not None:
        meter.wrap(scheduler.connector, SCHEDULER_CALLS)
        if worker is not None:
            meter.wrap(worker, WORKER_CALLS)
            send = meter.timed(roundtrip, "metadata pickle round trip")

    def step() -> None:
        output = scheduler.schedule()
        kv_output = None
        if worker is not None:
            worker.bind_connector_metadata(send(output.kv_connector_metadata))
            worker.start_load_kv(None)
            worker.wait_for_save()
            results = worker.get_transfer_results(output.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            stats = worker.get_kv_connector_stats()
            worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            kv_output = KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
                kv_connector_stats=stats,
                kv_connector_worker_meta=worker_meta,
            )
            kv_output = roundtrip(kv_output)
        runner_output = make_model_runner_output(output, scheduler, kv_connector_output=kv_output)
        scheduler.update_from_output(output, runner_output)
        load.refill()

    for _ in range(PROMPT_TOKENS // 16 + 2):  # the prefills
        step()
    return step


def hosted(
    connector: str,
    running: int,
    *,
    adapter: type | None = None,
    extra: dict[str, Any] | None = None,
    meter: Meter | None = None,
) -> Callable[[], None]:
    """Steps of a scheduler whose connector is kvconn's adapter hosting ``connector``.

    ``adapter`` puts another vLLM connector class in its place (the bare connector, an earlier tree's
    adapter), with ``extra`` added to its ``kv_connector_extra_config``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvconn_vllm import KVConnVllmConnector

    load = Load(connector, running)
    scheduler = load.scheduler
    cls = adapter or KVConnVllmConnector
    if adapter is not None:  # vLLM configured for kvconn's adapter, with this one in its place
        transfer = scheduler.vllm_config.kv_transfer_config
        transfer.kv_connector_extra_config = {**transfer.kv_connector_extra_config, **(extra or {})}
        scheduler.connector = cls(scheduler.vllm_config, KVConnectorRole.SCHEDULER, scheduler.kv_cache_config)
    return step_function(load, cls(scheduler.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config), meter)


def metered_rounds(
    metered: list[tuple[Callable[[], None], Meter]], repeat: int, steps: int
) -> list[tuple[list[float], list[float], Counter[str]]]:
    """Per step function and its meter, in interleaved rounds of ``steps`` steps each: the meter's seconds per
    step and its share (%) of the rest of the step, both on the meter's wall clock, per round; and per call,
    its seconds per step (median of rounds).

    The share on one clock is what a loaded machine does not inflate: time the CPU spends on other processes
    lands in kvconn's calls and in vLLM's alike, whereas the step times of :func:`round_times` are CPU time.
    Round ``i`` of one step function ran right after round ``i`` of the one before it, so their difference
    is what a slow spell of the machine touches least.
    """
    results: list[tuple[list[float], list[float], list[Counter[str]]]] = [([], [], []) for _ in metered]
    for round_ in range(repeat):
        order = range(len(metered)) if round_ % 2 == 0 else reversed(range(len(metered)))
        for (step, meter), (per_step, shares, per_call) in ((metered[i], results[i]) for i in order):
            before, started, by_call = meter.seconds, time.perf_counter(), meter.by_call.copy()
            for _ in range(steps):
                step()
            inside, wall = meter.seconds - before, time.perf_counter() - started
            per_step.append(inside / steps)
            shares.append(inside / (wall - inside) * 100)
            spent = meter.by_call.copy()
            spent.subtract(by_call)
            per_call.append(spent)
    medians = []
    for per_step, shares, per_call in results:
        calls = {name for spent in per_call for name in spent}
        by_call = {call: statistics.median(spent[call] / steps for spent in per_call) for call in calls}
        medians.append((per_step, shares, Counter({call: s for call, s in by_call.items() if s})))
    return medians
