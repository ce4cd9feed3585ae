"""Worker side: move blocks between the KV caches and the store.

The per-layer KV-cache tensors are registered with the store once; a block of
a group is one value whose parts are that block's bytes in each of the
group's layers (pointers straight into the KV caches: no staging copy). Each
step is at most one batched get (``start_load_kv``, before compute) and one
batched existence check plus one batched put (``wait_for_save``, after every
layer is computed). Nothing here raises on a store error: a failed load
reports its blocks through ``get_block_ids_with_load_errors`` (the engine
recomputes them), a failed save is skipped; both are counted and logged once.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn import ConnectorContext

from .codes import LEASE_EXPIRED, NOT_FOUND, OK, RPC_FAIL, STORE_FULL, code_name
from .degrade import Degradations
from .metadata import BlockTransfer, MooncakeMetadata
from .store import Store

__all__ = ["WorkerSide"]

_LOAD_FAILURES = {
    NOT_FOUND: "a block was gone when loaded (evicted, or its writer left); it is recomputed",
    LEASE_EXPIRED: "a block's lease expired during the load; it is recomputed",
    RPC_FAIL: "loads failed: the store is unreachable; the blocks are recomputed",
}
_SAVE_FAILURES = {
    STORE_FULL: "the store is full: blocks were not saved",
    RPC_FAIL: "saves failed: the store is unreachable; blocks were not saved",
}


class _GroupLayout:
    """Where block ``b`` of a group lives: one (pointer, size) part per layer."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        self.num_blocks = min(t.shape[0] for t in tensors)
        self.bases = [t.data_ptr() for t in tensors]
        self.strides = [t.stride(0) * t.element_size() for t in tensors]
        self.sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.value_bytes = sum(self.sizes)

    def parts(self, block_id: int) -> list[int]:
        return [base + block_id * stride for base, stride in zip(self.bases, self.strides, strict=True)]

    def copy_block(self, src: int, dst: int) -> None:
        for src_ptr, dst_ptr, size in zip(self.parts(src), self.parts(dst), self.sizes, strict=True):
            ctypes.memmove(dst_ptr, src_ptr, size)


class WorkerSide:
    def __init__(self, store: Store, context: ConnectorContext) -> None:
        self.store = store
        self.context = context
        self.degraded = Degradations()
        self.totals: Counter[str] = Counter()
        self._stats: Counter[str] = Counter()
        self._groups: list[_GroupLayout] | None = None
        self._metadata: MooncakeMetadata | None = None
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Check the layout (host memory, one contiguous block per row) and register every tensor once."""
        groups = []
        for g, spec in enumerate(self.context.kv_cache_groups):
            missing = [name for name in spec.layer_names if name not in kv_caches]
            if missing:
                raise ValueError(f"KV-cache group {g}: no tensor for layers {missing}")
            tensors = [kv_caches[name] for name in spec.layer_names]
            for name, t in zip(spec.layer_names, tensors, strict=True):
                if t.device.type != "cpu" or not t.is_contiguous():
                    raise ValueError(
                        f"layer {name!r}: the mooncake connector moves host-memory, contiguous KV caches; "
                        f"got a {'contiguous' if t.is_contiguous() else 'strided'} tensor on {t.device}"
                    )
            groups.append(_GroupLayout(tensors))
        for t in kv_caches.values():
            code = self.store.register_buffer(t.data_ptr(), t.numel() * t.element_size())
            if code != OK:
                self.degraded.record("register_errors", 1, f"register_buffer failed ({code_name(code)})")
        self._groups = groups

    def _layout(self, transfer: BlockTransfer) -> _GroupLayout:
        assert self._groups is not None, "transfers are checked by _valid first"
        return self._groups[transfer.group]

    def _parts(self, transfers: Sequence[BlockTransfer]) -> tuple[list[list[int]], list[list[int]]]:
        """Per transfer, the (pointers, sizes) of its block in each layer of its group."""
        layouts = [self._layout(t) for t in transfers]
        return [lay.parts(t.block_id) for lay, t in zip(layouts, transfers, strict=True)], [
            lay.sizes for lay in layouts
        ]

    def _valid(self, transfers: Sequence[BlockTransfer]) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """Split into transfers this worker can address and the rest (never touch memory out of range)."""
        groups = self._groups or []
        ok: list[BlockTransfer] = []
        bad: list[BlockTransfer] = []
        for t in transfers:
            addressable = 0 <= t.group < len(groups) and 0 < t.block_id < groups[t.group].num_blocks
            (ok if addressable else bad).append(t)
        return ok, bad

    def start_load_kv(self, metadata: MooncakeMetadata) -> None:
        """Load this step's blocks synchronously, before any layer is computed."""
        self._metadata = metadata
        if not metadata.loads:
            return
        loads, bad = self._valid(metadata.loads)
        self._fail_loads(bad, "unaddressable", "blocks could not be loaded (no registered KV cache or bad block id)")
        # One get per key: a batch naming a key twice reports success for every copy but fills only one
        # (observed with Mooncake 0.3.13). Requests sharing a prefix load it into blocks of their own,
        # so repeated keys are read once and copied locally.
        first: dict[str, BlockTransfer] = {}
        for transfer in loads:
            first.setdefault(transfer.key, transfer)
        unique = list(first.values())
        ptrs, sizes = self._parts(unique) if unique else ([], [])
        codes = dict(zip(first, self.store.batch_get_into(list(first), ptrs, sizes), strict=True))
        failed: dict[int, list[BlockTransfer]] = {}
        for transfer in loads:
            code, layout = codes[transfer.key], self._layout(transfer)
            if code == layout.value_bytes:
                if transfer is not first[transfer.key]:
                    layout.copy_block(first[transfer.key].block_id, transfer.block_id)
                self._count("blocks_loaded", 1)
                self._count("bytes_loaded", code)
            else:
                failed.setdefault(code if code < 0 else 0, []).append(transfer)
        for code, transfers in failed.items():
            if code == 0:
                self._fail_loads(transfers, "short_read", "a block's stored size did not match; it is recomputed")
            else:
                explanation = _LOAD_FAILURES.get(code, f"loads failed ({code_name(code)}); the blocks are recomputed")
                self._fail_loads(transfers, code_name(code), explanation)

    def _fail_loads(self, transfers: Sequence[BlockTransfer], reason: str, explanation: str) -> None:
        self._load_errors.update(t.block_id for t in transfers)
        self.degraded.record(f"load_failed_{reason}", len(transfers), explanation)

    def wait_for_save(self) -> None:
        """Save this step's blocks (after every layer is computed); skip keys already stored."""
        metadata = self._metadata
        if metadata is None or not metadata.saves:
            return
        saves, bad = self._valid(metadata.saves)
        self.degraded.record(
            "save_failed_unaddressable", len(bad), "blocks could not be saved (no registered KV cache or bad block id)"
        )
        exists = self.store.batch_is_exist([t.key for t in saves])
        todo = [t for t, e in zip(saves, exists, strict=True) if e != 1]
        self._count("blocks_skipped_existing", len(saves) - len(todo))
        ptrs, sizes = self._parts(todo) if todo else ([], [])
        codes = self.store.batch_put_from([t.key for t in todo], ptrs, sizes)
        failures: Counter[int] = Counter()
        for transfer, code in zip(todo, codes, strict=True):
            if code == OK:
                self._count("blocks_saved", 1)
                self._count("bytes_saved", self._layout(transfer).value_bytes)
            else:
                failures[code] += 1
        for code, n in failures.items():
            explanation = _SAVE_FAILURES.get(code, f"saves failed ({code_name(code)}): blocks were not saved")
            self.degraded.record(f"save_failed_{code_name(code)}", n, explanation)

    def get_finished(self) -> set[str]:
        """Requests whose held blocks were saved this step; ends the step."""
        metadata, self._metadata = self._metadata, None
        return set(metadata.finished_saves) if metadata is not None else set()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _count(self, key: str, n: int) -> None:
        self._stats[key] += n
        self.totals[key] += n

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call: blocks/bytes moved plus every degraded event."""
        stats, self._stats = self._stats, Counter()
        stats.update(self.degraded.take())
        return {key: float(value) for key, value in stats.items()}
