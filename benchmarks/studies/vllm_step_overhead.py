"""kvconn's cost per step inside vLLM's real scheduler, with a connector that does nothing.

What an engine pays for hosting kvconn at all: per step, the adapter's
translation of vLLM's ``SchedulerOutput``, the host's dispatch, the metadata
encode, vLLM's pickling of it (its ``MessageQueue``), the worker side's decode
and per-step hooks, the pickled worker output and ``update_connector_output``,
with ``NoOpConnector`` (empty metadata every step). Measured side by side, in
interleaved rounds, against the same vLLM scheduler without a connector, and
against one whose connector is a bare ``KVConnectorBase_V1`` that does nothing
(what vLLM itself spends on any connector), at 64, 256 and 1024 running
requests. The load is steady: requests of staggered lengths decode, and each
one that finishes is replaced by a new one (no preemption: the KV cache holds
every request's full length). kvconn's calls are also timed against the bare
connector's, metered the same way in the same interleaved rounds: even calls
that do nothing cost something in a step (the meter's clock reads, and a call
into code and objects that vLLM's own work has pushed out of the CPU caches),
and what kvconn itself adds is the difference. Runs in the vLLM venv
(``.venv-vllm/bin/python benchmarks/vllm_step_overhead.py``).
"""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from benchlib import Bench, bare_connector_class, parse_args, round_times

import kvconn
from kvconn_vllm.testing.harness import (
    make_model_runner_output,
    make_request,
    make_scheduler,
    prepare_environment,
    vllm_import_error,
)

__all__ = ["NoOpConnector", "main"]

PROMPT_TOKENS = 64  # 4 blocks of 16
MAX_OUTPUT = 768  # requests generate 256..MAX_OUTPUT tokens, staggered


class NoOpConnector(kvconn.KVConnector):
    """Sends empty metadata every step and does nothing else."""

    def build_connector_meta(self, scheduler_output: Any, block_state: Any) -> kvconn.KVConnectorMetadata:
        return kvconn.KVConnectorMetadata()


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


def less_meter(
    meter: Meter, calls_before: Counter[str], seconds: list[float], overhead: float, steps: int
) -> tuple[dict[str, float], float]:
    """Calls per step of the ``steps`` metered steps since ``calls_before``, and the median of ``seconds`` (per
    step) less the meter's own ``overhead`` for each of those calls."""
    calls = {call: (n - calls_before[call]) / steps for call, n in meter.calls.items()}
    return calls, statistics.median(seconds) - overhead * sum(calls.values())


#: Targets: kvconn's calls at most this share (%) of the plain step, median of rounds (issue 27).
TARGETS = {64: 2.0, 256: 1.0}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    prepare_environment()
    if error := vllm_import_error():
        print(f"cannot run: vLLM is not installed here ({error}); use .venv-vllm/bin/python", file=sys.stderr)
        return 2
    sizes = (8, 16) if args.quick else (64, 256, 1024)
    repeat = 3 if args.quick else 15
    meter_rounds = 3 if args.quick else 31  # rounds of the meters: their round-by-round differences are noisier
    bench = Bench(
        "kvconn's per-step cost inside vLLM's scheduler (no-op connector vs no connector)",
        ["running", "vLLM step us", "bare connector +us", "with kvconn +us", "kvconn calls us", "kvconn % min",
         "median", "max", "one-clock %", "CPU us", "CPU %", "bare calls us", "over bare %", "CPU over bare %"],
    )  # fmt: skip
    noop = f"{__name__ if __name__ != '__main__' else 'vllm_step_overhead'}:NoOpConnector"
    shares: dict[int, float] = {}
    cpu_shares: dict[int, float] = {}
    over_bare: dict[int, float] = {}
    cpu_over_bare: dict[int, float] = {}
    breakdowns: dict[str, dict[str, float]] = {}
    bare_class = bare_connector_class()
    for running in sizes:
        meter, bare_meter = Meter(), Meter()
        plain = step_function(Load(None, running))
        bare, with_kvconn = hosted(noop, running, adapter=bare_class), hosted(noop, running, meter=meter)
        rounds = round_times(plain, bare, with_kvconn, repeat=repeat, min_time=0.1, clock=time.thread_time)
        base, bare_s, kvconn_s = (statistics.median(r) for r in rounds)
        steps = max(3, int(0.1 / kvconn_s))
        # The bare connector metered the same way: what the meter and vLLM's calls of any connector cost in a step.
        metered_bare = hosted(noop, running, adapter=bare_class, meter=bare_meter)
        (inside, one_clock, _), (bare_inside, _, _) = metered_rounds(
            [(with_kvconn, meter), (metered_bare, bare_meter)], meter_rounds, steps
        )
        ratios = [seconds / base * 100 for seconds in inside]
        shares[running] = statistics.median(ratios)
        over_bare[running] = statistics.median((k - b) / base * 100 for k, b in zip(inside, bare_inside, strict=True))
        # The same steps on this thread's CPU clock, less what the meter counts of itself per call.
        cpu, bare_cpu = Meter(time.thread_time), Meter(time.thread_time)
        cpu_steps = [
            (hosted(noop, running, meter=cpu), cpu),
            (hosted(noop, running, adapter=bare_class, meter=bare_cpu), bare_cpu),
        ]
        made, bare_made = cpu.calls.copy(), bare_cpu.calls.copy()
        (cpu_inside, _, by_call), (bare_cpu_inside, _, bare_by_call) = metered_rounds(cpu_steps, meter_rounds, steps)
        overhead = cpu.overhead()
        per_step_calls, cpu_us = less_meter(cpu, made, cpu_inside, overhead, meter_rounds * steps)
        bare_calls, bare_cpu_us = less_meter(bare_cpu, bare_made, bare_cpu_inside, overhead, meter_rounds * steps)
        cpu_shares[running] = cpu_us / base * 100
        cpu_over_bare[running] = (cpu_us - bare_cpu_us) / base * 100
        bench.row(
            running, base * 1e6, (bare_s - base) * 1e6, (kvconn_s - base) * 1e6, statistics.median(inside) * 1e6,
            min(ratios), shares[running], max(ratios), statistics.median(one_clock), cpu_us * 1e6,
            cpu_shares[running], statistics.median(bare_inside) * 1e6, over_bare[running], cpu_over_bare[running],
        )  # fmt: skip
        for key, spent, calls in (
            (str(running), by_call, per_step_calls),
            (f"{running} bare", bare_by_call, bare_calls),
        ):
            per_call = {call: s - overhead * calls.get(call, 0) for call, s in spent.items()}
            breakdowns[key] = {call: round(s * 1e6, 2) for call, s in sorted(per_call.items(), key=lambda kv: -kv[1])}
            bench.notes.append(
                f"at {key} running, CPU us per step: "
                + ", ".join(f"{call} {us:.1f}" for call, us in breakdowns[key].items())
                + f" (meter's own {overhead * 1e6:.2f} us a call taken off, {sum(calls.values()):.1f} calls a step)"
            )
    for at, limit in TARGETS.items():
        if at not in shares:
            continue
        for what, measured in (
            ("kvconn adds", shares), ("kvconn's CPU time", cpu_shares),
            ("kvconn adds, over a bare connector metered alike,", over_bare),
            ("kvconn's CPU time over a bare connector's", cpu_over_bare),
        ):  # fmt: skip
            bench.target(
                f"{what} <= {limit:g}% of a step at {at} running requests (median of rounds)",
                measured[at] <= limit,
                f"{measured[at]:.2f}%",
            )
    bench.extra["cpu_us_per_step_by_call"] = breakdowns
    bench.notes.append(
        "a step: schedule() + the worker's connector calls (pickled metadata and output) + update_from_output(); "
        "step times: this thread's CPU time, medians of interleaved rounds ('+us': over the plain step, noisy); "
        "'kvconn calls': time inside the adapter's entry points and the metadata's pickling, per step (median of "
        "rounds); 'kvconn %': that, per round, over the plain step (a wall time over a CPU time: a loaded machine "
        "inflates it); "
        "'one-clock %': kvconn's wall time over the rest of the same steps' wall time (median of rounds); "
        "'CPU us': kvconn's calls on this thread's CPU clock, the meter's own cost per call taken off, and 'CPU %' "
        "that over the plain step (both CPU time: what a loaded machine does not inflate); 'bare calls': the bare "
        "connector's calls (and its metadata's round trip) metered the same way in the same rounds, what the "
        "meter and vLLM's calls of a connector that does nothing cost in a step; 'over bare %' and 'CPU over "
        "bare %': kvconn's calls less the bare connector's, round by round, over the plain step (what kvconn "
        "itself adds); per call: CPU us per step, median of rounds, kvconn's and (\"bare\") the bare connector's "
        "(request_finished holds "
        "request_finished_all_groups, which it calls)"
    )
    return bench.finish(args)


if __name__ == "__main__":
    sys.exit(main())
