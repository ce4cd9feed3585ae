"""Worker side: move blocks between the KV caches and the store.

A block of a group is one value: a 64-byte integrity header (see
:mod:`kvconn_mooncake.integrity`) followed by that block's bytes in each of the
group's layers. Saves gather the value straight from the KV caches (the parts
are the header, then pointers into each layer's tensor: no copy). Loads land
in a registered staging buffer first and are verified (size, header, key,
layout, checksum or MAC); only verified payloads are copied into the KV
caches, so a short, torn, foreign or forged value never reaches them. Each
step is at most one batched get (``start_load_kv``, before compute) and one
batched existence check plus one batched put (``wait_for_save``, after every
layer is computed). Nothing here raises on a store error: a failed load
reports its blocks through ``get_block_ids_with_load_errors`` (the engine
recomputes them), a failed save is skipped; both are counted, logged once,
and reported as ``degraded_events`` in the step's stats.

The Python around each store call is the connector's overhead over a raw
batch call, so it stays per batch, not per block, wherever it can: the part
pointers of a whole batch come from one vectorised multiply-add over the
per-layer bases and strides taken at registration, block ids are range-checked
per group with ``min``/``max``, and results are counted per group with
``list.count``; the per-block work is the checksum and, on load, the copy out
of staging.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kvconn import NULL_BLOCK_ID, ConnectorContext

from .backends import StoreLease, StoreSide
from .codes import LEASE_EXPIRED, NOT_FOUND, OK, RPC_FAIL, STORE_FULL, code_name
from .config import MooncakeConfig
from .degrade import Degradations
from .integrity import HEADER_BYTES, Integrity, layout_digest
from .metadata import BlockTransfer, MooncakeMetadata
from .store import Store

__all__ = ["WorkerSide"]

_THREADS = min(8, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None

T = TypeVar("T")
R = TypeVar("R")


def _parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, in one chunk per thread: checksums and copies release the GIL."""
    global _POOL
    if _THREADS == 1 or len(items) < 2 * _THREADS:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="kvconn-mooncake-blocks")
    size = -(-len(items) // _THREADS)
    chunks = [items[i : i + size] for i in range(0, len(items), size)]
    return [r for done in _POOL.map(lambda chunk: [fn(x) for x in chunk], chunks) for r in done]


_LOAD_FAILURES = {  # by reason: a code's name, or what the check of a staged value found
    code_name(NOT_FOUND): "a block was gone when loaded (evicted, or its writer left); it is recomputed",
    code_name(LEASE_EXPIRED): "a block's lease expired during the load; it is recomputed",
    code_name(RPC_FAIL): "loads failed: the store is unreachable or timed out; the blocks are recomputed",
    "short_read": "a block's stored size did not match; it is recomputed",
}
_SAVE_FAILURES = {
    STORE_FULL: "the store is full: blocks were not saved",
    RPC_FAIL: "saves failed: the store is unreachable or timed out; blocks were not saved",
}

Buckets = dict[int, list[BlockTransfer]]  # KV-cache group -> its transfers


class _GroupLayout:
    """Where block ``b`` of a group lives: part ``l`` at ``bases[l] + b * strides[l]``, ``sizes[l]`` bytes."""

    def __init__(self, names: Sequence[str], tensors: Sequence[Any]) -> None:
        import torch  # the KV caches are torch tensors: torch is loaded already

        self.num_blocks = min(t.shape[0] for t in tensors)
        self.sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.value_bytes = sum(self.sizes)
        self.digest = layout_digest(
            [(n, tuple(t.shape[1:]), str(t.dtype)) for n, t in zip(names, tensors, strict=True)]
        )
        self._bases = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
        self._strides = torch.tensor([t.stride(0) * t.element_size() for t in tensors], dtype=torch.int64)
        # The same memory as bytes, to checksum parts without a copy: (layer's bytes, stride, part size).
        self._layers = [
            (memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B"), s, n)
            for t, s, n in zip(tensors, self._strides.tolist(), self.sizes, strict=True)
        ]

    def pointers(self, block_ids: list[int]) -> list[list[int]]:
        """Per block, the address of its part in each layer (ids must be in range: see ``_by_group``)."""
        ids = self._bases.new_tensor(block_ids).unsqueeze(1)
        pointers: list[list[int]] = (ids * self._strides + self._bases).tolist()
        return pointers

    def parts(self, block_id: int) -> list[memoryview]:
        """Block ``block_id``'s bytes in each layer, as views (no copy)."""
        return [view[block_id * stride : block_id * stride + size] for view, stride, size in self._layers]


@dataclass
class _Slot:
    """Where the value of ``key`` lands in staging, and what the get returned (bytes read or an error)."""

    key: str
    offset: int
    size: int
    layout: _GroupLayout
    code: int = 0


class _Arena:
    """Registered host memory the store reads headers from or writes staged values into; grows, never shrinks.

    Memory outgrown stays alive (and registered): a store call that timed out
    may still be using it.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.buffer = bytearray()
        self.address = 0
        self._outgrown: list[bytearray] = []

    def ensure(self, size: int) -> memoryview:
        if size > len(self.buffer):
            self._outgrown.append(self.buffer)
            self.buffer = bytearray(max(size, 2 * len(self.buffer)))
            self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
            self.store.register_buffer(self.address, len(self.buffer))
        return memoryview(self.buffer)


class WorkerSide(StoreSide):
    """The worker side of ``mooncake``: one batched get before compute, one batched put after it.

    Its keys are its own namespace per group: under tensor parallelism each rank stores its shard apart.
    """

    def __init__(self, config: MooncakeConfig, context: ConnectorContext, lease: StoreLease | None = None) -> None:
        super().__init__(config, context, lease)
        self.context = context
        self.integrity = Integrity(config.integrity_secret)
        self.degraded = Degradations()
        self.totals: Counter[str] = Counter()
        self._stats: Counter[str] = Counter()
        self._groups: list[_GroupLayout] = []
        self._headers = _Arena(self.store)  # saves: one header per value
        self._staging = _Arena(self.store)  # loads: values land here and are verified before the KV caches
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
            groups.append(_GroupLayout(spec.layer_names, tensors))
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
            bucket, limit, prefix = buckets[g], self._groups[g].num_blocks, self.keys.prefixes[g]
            if not all(t.key.startswith(prefix) for t in bucket):
                # Named in the scheduler's namespace (TP rank 0 under vLLM): this rank's shard has keys of its own,
                # or ranks would load each other's shards (same layout, so the header check cannot tell).
                bucket = buckets[g] = [BlockTransfer(prefix + t.key.rpartition("/")[2], t.block_id, g) for t in bucket]
            ids = [t.block_id for t in bucket]
            if min(ids) <= NULL_BLOCK_ID or max(ids) >= limit:  # the null block holds no data
                buckets[g] = [t for t in bucket if NULL_BLOCK_ID < t.block_id < limit]
                bad += [t for t in bucket if not NULL_BLOCK_ID < t.block_id < limit]
        return buckets, bad

    def start_load_kv(self, metadata: MooncakeMetadata) -> None:
        """Load this step's blocks synchronously, before any layer is computed: stage, verify, then copy."""
        self._metadata = metadata
        if not metadata.loads:
            return
        buckets, bad = self._by_group(metadata.loads)
        self._fail_loads(bad, "unaddressable", "blocks could not be loaded (no registered KV cache or bad block id)")
        # One staging slot per distinct key: a key named twice in a batch get fills only one destination
        # (Mooncake 0.3.13), and requests sharing a prefix load it into blocks of their own, all from one slot.
        slots: dict[str, _Slot] = {}
        end = 0
        for g, transfers in buckets.items():
            layout = self._groups[g]
            size = HEADER_BYTES + layout.value_bytes
            for t in transfers:
                if t.key not in slots:
                    slots[t.key], end = _Slot(t.key, end, size, layout), end + size
        staging = self._staging.ensure(end)
        base = self._staging.address
        codes = self.store.batch_get_into(
            list(slots), [[base + slot.offset] for slot in slots.values()], [[slot.size] for slot in slots.values()]
        )
        for slot, code in zip(slots.values(), codes, strict=True):
            slot.code = code
        outcomes = _parallel(lambda slot: self._verdict(slot, staging), list(slots.values()))
        verdicts = dict(zip(slots, outcomes, strict=True))
        copies: list[tuple[int, list[int], list[int]]] = []  # (source in staging, destinations, sizes)
        moved = 0
        failed: dict[str, list[BlockTransfer]] = {}
        for g, transfers in buckets.items():
            layout = self._groups[g]
            for t, pointers in zip(transfers, layout.pointers([t.block_id for t in transfers]), strict=True):
                verdict = verdicts[t.key]
                if verdict is None:
                    copies.append((base + slots[t.key].offset + HEADER_BYTES, pointers, layout.sizes))
                    moved += layout.value_bytes
                else:
                    failed.setdefault(verdict, []).append(t)
        _parallel(_copy_out, copies)
        self._count("blocks_loaded", len(copies))
        self._count("bytes_loaded", moved)
        for reason, transfers in failed.items():
            self._fail_loads(transfers, reason, _load_failure(reason))

    def _verdict(self, slot: _Slot, staging: memoryview) -> str | None:
        """Why the value read into ``slot`` must not be loaded, or ``None`` when it may."""
        if slot.code < 0:
            return code_name(slot.code)
        if slot.code != slot.size:
            return "short_read"
        value = staging[slot.offset : slot.offset + slot.size]
        reason = self.integrity.verify(slot.key, slot.layout.digest, value)
        return None if reason is None else f"integrity_{reason}"

    def _fail_loads(self, transfers: Sequence[BlockTransfer], reason: str, explanation: str) -> None:
        self._load_errors.update(t.block_id for t in transfers)
        self.degraded.record(f"load_failed_{reason}", len(transfers), explanation)

    def wait_for_save(self) -> None:
        """Save this step's blocks (after every layer is computed), each sealed; skip keys already stored."""
        metadata = self._metadata
        if metadata is None or not metadata.saves:
            return
        buckets, bad = self._by_group(metadata.saves)
        self.degraded.record(
            "save_failed_unaddressable", len(bad), "blocks could not be saved (no registered KV cache or bad block id)"
        )
        skipped = _drop_existing(buckets, self.store.batch_is_exist([t.key for b in buckets.values() for t in b]))
        self._count("blocks_skipped_existing", skipped)
        headers = self._headers.ensure(HEADER_BYTES * sum(len(b) for b in buckets.values()))
        base = self._headers.address
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        sealing: list[tuple[BlockTransfer, _GroupLayout]] = []  # in the put's order
        for g, transfers in buckets.items():
            layout = self._groups[g]
            parts = [HEADER_BYTES, *layout.sizes]
            for t, pointers in zip(transfers, layout.pointers([t.block_id for t in transfers]), strict=True):
                ptrs.append([base + HEADER_BYTES * len(sealing), *pointers])
                sizes.append(parts)
                sealing.append((t, layout))
        headers[: HEADER_BYTES * len(sealing)] = b"".join(_parallel(self._seal, sealing))
        codes = self.store.batch_put_from([t.key for t, _ in sealing], ptrs, sizes)
        saved = [layout.value_bytes for (_, layout), code in zip(sealing, codes, strict=True) if code == OK]
        self._count("blocks_saved", len(saved))
        self._count("bytes_saved", sum(saved))
        for code, n in Counter(code for code in codes if code != OK).items():
            explanation = _SAVE_FAILURES.get(code, f"saves failed ({code_name(code)}): blocks were not saved")
            self.degraded.record(f"save_failed_{code_name(code)}", n, explanation)

    def _seal(self, item: tuple[BlockTransfer, _GroupLayout]) -> bytes:
        transfer, layout = item
        return self.integrity.seal(transfer.key, layout.digest, layout.parts(transfer.block_id))

    def get_finished(self) -> tuple[set[str], None]:
        """Requests whose held blocks were saved this step (loads are synchronous); ends the step."""
        metadata, self._metadata = self._metadata, None
        return set(metadata.finished_saves) if metadata is not None else set(), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _count(self, key: str, n: int) -> None:
        if n:
            self._stats[key] += n
            self.totals[key] += n

    def get_kv_connector_stats(self) -> dict[str, float]:
        """Counters since the last call: blocks/bytes moved, every degraded event, and their sum.

        ``degraded_events`` counts the blocks whose load or save degraded
        (store errors, timeouts, values that failed verification), so an
        engine that sums it reports a store outage rather than zero.
        """
        stats, self._stats = self._stats, Counter()
        degraded = self.degraded.take()
        stats.update(degraded)
        if degraded:
            stats["degraded_events"] = sum(degraded.values())
        return {key: float(value) for key, value in stats.items()}


def _copy_out(copy: tuple[int, list[int], list[int]]) -> None:
    """Copy a verified payload from staging into its block's parts, in layer order."""
    src, destinations, sizes = copy
    for dst, size in zip(destinations, sizes, strict=True):
        ctypes.memmove(dst, src, size)
        src += size


def _load_failure(reason: str) -> str:
    """What a failed load of ``reason`` means, for the log."""
    if reason.startswith("integrity_"):
        return (
            f"a stored value failed verification ({reason[10:]}): it was not written by this connector for this key "
            "and KV layout, or it is damaged; it never reaches the KV cache and the block is recomputed"
        )
    return _LOAD_FAILURES.get(reason, f"loads failed ({reason}); the blocks are recomputed")


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
