"""Batched block copies between the KV caches and the host pool (the hot path).

Every layer's KV cache is viewed as ``[num_blocks, row]`` rows of the widest
integer-like dtype that divides a block's bytes (16-byte ``complex128`` words
for usual shapes): the copies move bytes, never values, and wide elements make
torch's index kernels run at memcpy speed. The pool is ``[num_layers,
num_host_blocks, row]``.

A copy is one batched torch op per *run* of consecutive host blocks: an
``index`` gather with ``out=`` the pool slice moves the device rows straight
into their host blocks (save; the TensorIterator ``index`` kernel, which kept
up with memcpy on 1 MiB rows where ``index_select``'s dim-0 path did not),
and ``index_copy_(pool slice)`` scatters host rows into their device blocks
(load), one pass over the bytes. The manager hands out the
lowest free slots, so a step's stores are one run or a few. When a plan has
more than :data:`MAX_RUNS` runs (a fragmented pool), it falls back to two
batched passes through a reused staging buffer. No Python loop per block.

On CUDA the same plan runs on a side stream: saves gather on the device, then
copy each run to pinned host memory non-blocking; loads copy runs to a device
staging buffer non-blocking, then scatter with ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_RUNS", "BlockCopier", "CopyPlan", "wide_rows"]

#: Above this many host runs a plan copies through a staging buffer instead.
MAX_RUNS = 8

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
        return cls(
            torch.tensor([d for _, d in pairs], dtype=torch.long, device=device),
            torch.tensor(hosts, dtype=torch.long, device=device),
            runs,
        )

    def __len__(self) -> int:
        return int(self.device.shape[0])


class BlockCopier:
    """Copies planned blocks of one layer between a KV cache and the pool.

    ``pool`` is the result of :func:`wide_rows` over ``[layers, host_blocks, ...]``.
    Synchronous on CPU; on CUDA the caller runs it inside a side-stream context.
    """

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._staging: Any = None

    def _stage(self, n: int, like: Any) -> Any:
        if self._staging is None or self._staging.shape[0] < n or self._staging.device != like.device:
            self._staging = torch.empty((n, like.shape[1]), dtype=like.dtype, device=like.device)
        return self._staging[:n]

    def save(self, layer: int, kv_rows: Any, plan: CopyPlan) -> None:
        """Device rows -> host blocks of ``layer``."""
        pool = self.pool[layer]
        if kv_rows.device.type != "cpu":
            gathered = kv_rows.index_select(0, plan.device)
            for start, end, host in plan.runs:
                pool[host : host + end - start].copy_(gathered[start:end], non_blocking=True)
        elif len(plan.runs) <= MAX_RUNS:
            for start, end, host in plan.runs:
                torch.ops.aten.index.Tensor_out(kv_rows, [plan.device[start:end]], out=pool[host : host + end - start])
        else:
            staging = self._stage(len(plan), kv_rows)
            torch.index_select(kv_rows, 0, plan.device, out=staging)
            pool.index_copy_(0, plan.host, staging)

    def load(self, layer: int, kv_rows: Any, plan: CopyPlan) -> None:
        """Host blocks of ``layer`` -> device rows."""
        pool = self.pool[layer]
        if kv_rows.device.type != "cpu":
            staging = self._stage(len(plan), kv_rows)
            for start, end, host in plan.runs:
                staging[start:end].copy_(pool[host : host + end - start], non_blocking=True)
            kv_rows.index_copy_(0, plan.device, staging)
        elif len(plan.runs) <= MAX_RUNS:
            for start, end, host in plan.runs:
                kv_rows.index_copy_(0, plan.device[start:end], pool[host : host + end - start])
        else:
            staging = self._stage(len(plan), kv_rows)
            torch.index_select(pool, 0, plan.host, out=staging)
            kv_rows.index_copy_(0, plan.device, staging)
