"""Worker side: move blocks between the KV caches and the store.

The per-layer KV-cache tensors are registered with the store once; a block of
a group is one value whose parts are that block's bytes in each of the
group's layers (pointers straight into the KV caches: no staging copy). Each
step is at most one batched get (``start_load_kv``, before compute) and one
batched existence check plus one batched put (``wait_for_save``, after every
layer is computed). Nothing here raises on a store error: a failed load
reports its blocks through ``get_block_ids_with_load_errors`` (the engine
recomputes them), a failed save is skipped; both are counted and logged once.

The Python around each store call is the connector's only overhead over a raw
batch call, so it stays per batch, not per block, wherever it can: the part
pointers of a whole batch come from one vectorised multiply-add over the
per-layer bases and strides taken at registration, block ids are range-checked
per group with ``min``/``max``, results are counted per group with
``list.count``, and only failures are looked at one by one.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvconn import NULL_BLOCK_ID, ConnectorContext

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
_SHORT_READ = 0  # failure code of a get that read a value of another size than the block's

Buckets = dict[int, list[BlockTransfer]]  # KV-cache group -> its transfers


class _GroupLayout:
    """Where block ``b`` of a group lives: part ``l`` at ``bases[l] + b * strides[l]``, ``sizes[l]`` bytes."""

    def __init__(self, tensors: Sequence[Any]) -> None:
        import torch  # the KV caches are torch tensors: torch is loaded already

        self.num_blocks = min(t.shape[0] for t in tensors)
        self.sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.value_bytes = sum(self.sizes)
        self._bases = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        self._strides = torch.tensor([t.stride(0) * t.element_size() for t in tensors], dtype=torch.int64)

    def pointers(self, block_ids: list[int]) -> list[list[int]]:
        """Per block, the address of its part in each layer (ids must be in range: see ``_by_group``)."""
        ids = self._bases.new_tensor(block_ids).unsqueeze(1)
        pointers: list[list[int]] = (ids * self._strides + self._bases).tolist()
        return pointers

    def copy_block(self, src: int, dst: int) -> None:
        src_ptrs, dst_ptrs = self.pointers([src, dst])
        for src_ptr, dst_ptr, size in zip(src_ptrs, dst_ptrs, self.sizes, strict=True):
            ctypes.memmove(dst_ptr, src_ptr, size)


class _Batch:
    """One batched store call: every transfer's key and parts, in group order."""

    def __init__(self, layouts: Sequence[_GroupLayout], buckets: Buckets) -> None:
        self.keys: list[str] = []
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.spans: list[tuple[_GroupLayout, list[BlockTransfer]]] = []
        for g, transfers in buckets.items():
            if transfers:
                layout = layouts[g]
                self.keys += [t.key for t in transfers]
                self.ptrs += layout.pointers([t.block_id for t in transfers])
                self.sizes += [layout.sizes] * len(transfers)
                self.spans.append((layout, transfers))

    def outcome(self, codes: list[int], *, loading: bool) -> tuple[int, int, Buckets]:
        """Blocks and bytes moved, and the failed transfers by code.

        A put succeeds with ``OK``, a get with the block's size in bytes; a get
        of any other size fails as ``_SHORT_READ``.
        """
        blocks = moved = start = 0
        failed: Buckets = {}
        for layout, transfers in self.spans:
            span = codes[start : start + len(transfers)]
            start += len(transfers)
            success = layout.value_bytes if loading else OK
            ok = span.count(success)
            if ok < len(transfers):
                for transfer, code in zip(transfers, span, strict=True):
                    if code != success:
                        failed.setdefault(_SHORT_READ if loading and code >= 0 else code, []).append(transfer)
            blocks, moved = blocks + ok, moved + ok * layout.value_bytes
        return blocks, moved, failed


def _drop_repeated_keys(buckets: Buckets) -> list[tuple[BlockTransfer, BlockTransfer]]:
    """Keep each key's first transfer in ``buckets``; return the others with the transfer they repeat.

    A batch naming a key twice reports success for every copy but fills only one
    (observed with Mooncake 0.3.13). Requests sharing a prefix load it into
    blocks of their own, so a repeated key is read once and copied locally.
    Keys are namespaced by group, so a key repeats only within one bucket.
    """
    repeats: list[tuple[BlockTransfer, BlockTransfer]] = []
    for g, transfers in buckets.items():
        if len({t.key for t in transfers}) == len(transfers):
            continue
        first: dict[str, BlockTransfer] = {}
        for t in transfers:
            kept = first.setdefault(t.key, t)
            if kept is not t:
                repeats.append((t, kept))
        buckets[g] = list(first.values())
    return repeats


class WorkerSide:
    """The worker side of ``mooncake``: one batched get before compute, one batched put after it."""

    def __init__(self, store: Store, context: ConnectorContext) -> None:
        self.store = store
        self.context = context
        self.degraded = Degradations()
        self.totals: Counter[str] = Counter()
        self._stats: Counter[str] = Counter()
        self._groups: list[_GroupLayout] = []
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

    def _by_group(self, transfers: Sequence[BlockTransfer]) -> tuple[Buckets, list[BlockTransfer]]:
        """The transfers this worker can address, by group, and the rest (never touch memory out of range)."""
        buckets: Buckets = {}
        for t in transfers:
            buckets.setdefault(t.group, []).append(t)
        bad: list[BlockTransfer] = []
        for g in list(buckets):
            if not 0 <= g < len(self._groups):
                bad += buckets.pop(g)
                continue
            bucket, limit = buckets[g], self._groups[g].num_blocks
            ids = [t.block_id for t in bucket]
            if min(ids) <= NULL_BLOCK_ID or max(ids) >= limit:  # the null block holds no data
                buckets[g] = [t for t in bucket if NULL_BLOCK_ID < t.block_id < limit]
                bad += [t for t in bucket if not NULL_BLOCK_ID < t.block_id < limit]
        return buckets, bad

    def start_load_kv(self, metadata: MooncakeMetadata) -> None:
        """Load this step's blocks synchronously, before any layer is computed."""
        self._metadata = metadata
        if not metadata.loads:
            return
        buckets, bad = self._by_group(metadata.loads)
        self._fail_loads(bad, "unaddressable", "blocks could not be loaded (no registered KV cache or bad block id)")
        repeats = _drop_repeated_keys(buckets)
        batch = _Batch(self._groups, buckets)
        blocks, moved, failed = batch.outcome(
            self.store.batch_get_into(batch.keys, batch.ptrs, batch.sizes), loading=True
        )
        if repeats:
            failed_code = {t.key: code for code, transfers in failed.items() for t in transfers}
            for repeat, first in repeats:
                code = failed_code.get(first.key)
                if code is None:
                    layout = self._groups[repeat.group]
                    layout.copy_block(first.block_id, repeat.block_id)
                    blocks, moved = blocks + 1, moved + layout.value_bytes
                else:
                    failed[code].append(repeat)
        self._count("blocks_loaded", blocks)
        self._count("bytes_loaded", moved)
        for code, transfers in failed.items():
            if code == _SHORT_READ:
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
        buckets, bad = self._by_group(metadata.saves)
        self.degraded.record(
            "save_failed_unaddressable", len(bad), "blocks could not be saved (no registered KV cache or bad block id)"
        )
        skipped = _drop_existing(buckets, self.store.batch_is_exist([t.key for b in buckets.values() for t in b]))
        self._count("blocks_skipped_existing", skipped)
        batch = _Batch(self._groups, buckets)
        blocks, moved, failed = batch.outcome(
            self.store.batch_put_from(batch.keys, batch.ptrs, batch.sizes), loading=False
        )
        self._count("blocks_saved", blocks)
        self._count("bytes_saved", moved)
        for code, transfers in failed.items():
            explanation = _SAVE_FAILURES.get(code, f"saves failed ({code_name(code)}): blocks were not saved")
            self.degraded.record(f"save_failed_{code_name(code)}", len(transfers), explanation)

    def get_finished(self) -> set[str]:
        """Requests whose held blocks were saved this step; ends the step."""
        metadata, self._metadata = self._metadata, None
        return set(metadata.finished_saves) if metadata is not None else set()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _count(self, key: str, n: int) -> None:
        if n:
            self._stats[key] += n
            self.totals[key] += n

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call: blocks/bytes moved plus every degraded event."""
        stats, self._stats = self._stats, Counter()
        stats.update(self.degraded.take())
        return {key: float(value) for key, value in stats.items()}


def _drop_existing(buckets: Buckets, exists: list[int]) -> int:
    """Remove the transfers whose key is stored already (``exists`` in bucket order); return how many."""
    if 1 not in exists:
        return 0
    start = skipped = 0
    for g, transfers in buckets.items():
        span = exists[start : start + len(transfers)]
        start += len(transfers)
        buckets[g] = [t for t, e in zip(transfers, span, strict=True) if e != 1]
        skipped += len(transfers) - len(buckets[g])
    return skipped
