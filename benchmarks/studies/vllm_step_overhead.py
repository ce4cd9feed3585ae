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
(``.venv-vllm/bin/python benchmarks/studies/vllm_step_overhead.py``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter

from benchlib import CANNOT_RUN, Bench, parse_args, round_times
from benchlib.connectors import bare_connector_class
from benchlib.vllm_step import NOOP, Load, Meter, hosted, metered_rounds, step_function

from kvconn_vllm.testing.harness import prepare_environment, vllm_import_error

__all__ = ["main"]


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
        return CANNOT_RUN
    sizes = (8, 16) if args.quick else (64, 256, 1024)
    repeat = 3 if args.quick else 15
    meter_rounds = 3 if args.quick else 31  # rounds of the meters: their round-by-round differences are noisier
    bench = Bench(
        "kvconn's per-step cost inside vLLM's scheduler (no-op connector vs no connector)",
        ["running", "vLLM step us", "bare connector +us", "with kvconn +us", "kvconn calls us", "kvconn % min",
         "median", "max", "one-clock %", "CPU us", "CPU %", "bare calls us", "over bare %", "CPU over bare %"],
    )  # fmt: skip
    shares: dict[int, float] = {}
    cpu_shares: dict[int, float] = {}
    over_bare: dict[int, float] = {}
    cpu_over_bare: dict[int, float] = {}
    breakdowns: dict[str, dict[str, float]] = {}
    bare_class = bare_connector_class()
    for running in sizes:
        meter, bare_meter = Meter(), Meter()
        plain = step_function(Load(None, running))
        bare, with_kvconn = hosted(NOOP, running, adapter=bare_class), hosted(NOOP, running, meter=meter)
        rounds = round_times(plain, bare, with_kvconn, repeat=repeat, min_time=0.1, clock=time.thread_time)
        base, bare_s, kvconn_s = (statistics.median(r) for r in rounds)
        steps = max(3, int(0.1 / kvconn_s))
        # The bare connector metered the same way: what the meter and vLLM's calls of any connector cost in a step.
        metered_bare = hosted(NOOP, running, adapter=bare_class, meter=bare_meter)
        (inside, one_clock, _), (bare_inside, _, _) = metered_rounds(
            [(with_kvconn, meter), (metered_bare, bare_meter)], meter_rounds, steps
        )
        ratios = [seconds / base * 100 for seconds in inside]
        shares[running] = statistics.median(ratios)
        over_bare[running] = statistics.median((k - b) / base * 100 for k, b in zip(inside, bare_inside, strict=True))
        # The same steps on this thread's CPU clock, less what the meter counts of itself per call.
        cpu, bare_cpu = Meter(time.thread_time), Meter(time.thread_time)
        cpu_steps = [
            (hosted(NOOP, running, meter=cpu), cpu),
            (hosted(NOOP, running, adapter=bare_class, meter=bare_cpu), bare_cpu),
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
