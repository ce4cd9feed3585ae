"""Worker side: the host pool and the copies.

The pool is allocated once in ``register_kv_caches``. Per step (kvconn's
worker contract): ``start_load_kv`` plans this step's store and starts all its
loads as one batch (one plan per KV-cache group across every request, so runs
of host slots coalesce across requests; async loads: their requests are not
computed until reported in ``finished_recving``); ``save_kv_layer`` copies each
layer's stored blocks once the layer is computed (on CPU it notes the layer, and
the copies run in ``wait_for_save``, see below); ``wait_for_save`` closes the
step's store job; ``get_finished`` reports finished loads and delayed frees
whose stores are done, and the stats carry the highest finished store job back
to the scheduler side.

A slot is trusted (loadable) only when its copy was made in every layer: a
``save_kv_layer`` that arrives before the step was set up copies nothing, and
its job then completes without trusting any slot, so a later load of them is
reported as a load error (recomputed), never served from unwritten memory.
The stats count copies made, not copies planned.

On CPU every copy is synchronous, and a step's saves run together in
``wait_for_save``, not between two layers' compute: right after a layer's
matrix products, the first copy out of the KV cache ran 4-5x slower than the
same copy made after another copy (a 2-block save: 130 us a layer inside vLLM,
against 30 us for the same copies back to back; benchmarks/history/2026-log.md,
"Offload's CPU saves at the end of the step"). Nothing is lost by waiting: a
CPU copy overlaps no compute, and a forward writes each layer's blocks once, so
the rows a save reads are the same at the step's end. On CUDA copies run
non-blocking on one side stream (so they run in issue order: a slot re-stored
after a load is written after that load read it). Each use of the side stream
first waits for the work issued so far on the compute stream, so a save reads a
layer only after it was written and a load writes blocks only after earlier
compute is done with them. Every tensor the copies use is allocated on the side
stream, so the caching allocator never hands its memory to the compute stream
while a copy still runs. Completion is polled with events, and the next step's
compute waits for the previous store job, so no device block freed by
preemption is overwritten while a copy still reads it."""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from kvconn import ConnectorConfigError, ConnectorContext

from .config import OffloadConfig
from .copy import BlockCopier, CopyPlan, wide_rows
from .metadata import BlockTransfer, OffloadMetadata
from .scheduler import BLOCKING_COPIES_STAT, LOADS_DONE_STAT, POOL_SLOTS_STAT, STORES_DONE_STAT

__all__ = ["OffloadWorker", "check_pin_mode"]

logger = logging.getLogger("kvconn_offload")


def check_pin_mode(mode: str) -> None:
    """``pin_memory: always`` needs an accelerator: refuse it early, with the fix."""
    if mode == "always" and not torch.cuda.is_available():
        raise ConnectorConfigError(
            "invalid config for connector 'offload': field 'pin_memory': 'always' needs a CUDA device, "
            "and none is available; use 'auto' (pins only when one is) or 'never'"
        )


@dataclass
class _Load:
    req_id: str
    event: Any = None  # CUDA event recorded after the load's copies; None: done


class OffloadWorker:
    """The worker side of ``offload``: owns the host pool and runs the copies the scheduler side plans."""

    def __init__(self, config: OffloadConfig, context: ConnectorContext) -> None:
        check_pin_mode(config.pin_memory)
        self.config = config
        self.context = context
        self.multiple = config.block_size_multiple
        self.pool: Any = None
        self.pinned = False
        self.num_slots = 0
        self._layers: dict[str, int] = {}
        self._group_of: list[int] = []
        self._block_bytes: list[int] = []  # per KV-cache group: bytes of one engine block over its layers
        self._rows: list[Any] = []
        self._copier: BlockCopier | None = None
        self._stream: Any = None
        self._slot_keys: dict[int, bytes] = {}
        self._store_seq = 0
        self._store_plans: list[CopyPlan | None] = []
        self._store_tags: dict[int, bytes] = {}
        self._saved_layers: set[int] = set()  # layers this step's store job copied (on CPU: copies at wait_for_save)
        self._jobs: deque[tuple[int, dict[int, bytes], Any]] = deque()  # store jobs in flight: seq, tags, event
        self._done_seq = 0
        self._loads_done = 0  # the highest sync load batch run
        self._last_store: dict[str, int] = {}
        self._finishing: set[str] = set()
        self._loads: list[_Load] = []
        self._errors: set[int] = set()
        self._stats: dict[str, float] = {}
        self._report_slots = True

    # --------------------------------------------------------------- the pool

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        group_of = self.context.group_of_layer()
        missing = sorted(set(group_of) - set(kv_caches))
        if missing:
            raise ValueError(f"no KV cache was registered for layers {missing} of the engine's KV-cache groups")
        names = list(group_of)
        first = kv_caches[names[0]]
        for name in names:
            kv = kv_caches[name]
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise ValueError(f"layer {name!r}: every KV cache must share shape, dtype and device to share a pool")
            if not kv.is_contiguous():
                raise ValueError(f"layer {name!r}: the KV cache must be contiguous")
        self._layers = {name: i for i, name in enumerate(names)}
        self._group_of = [group_of[name] for name in names]
        self._rows = [wide_rows(kv_caches[name]) for name in names]
        block_bytes = first[0].numel() * first.element_size()
        self._block_bytes = [block_bytes * self._group_of.count(g) for g in range(len(self.context.kv_cache_groups))]
        if self.config.pool_bytes is not None:
            self.num_slots = self.config.pool_bytes // (len(names) * self.multiple * block_bytes)
            if self.num_slots < 1:
                raise ConnectorConfigError(
                    f"invalid config for connector 'offload': field 'pool_bytes': {self.config.pool_bytes} bytes "
                    f"hold no offloaded block of {len(names) * self.multiple * block_bytes} bytes; raise it"
                )
        else:
            slots = self.config.num_slots
            assert slots is not None, "pool_bytes unset: the config alone sizes the pool"
            self.num_slots = slots
        on_device = first.device.type == "cuda"
        mode = self.config.pin_memory
        self.pinned = mode == "always" or (mode == "auto" and on_device and torch.cuda.is_available())
        shape = (len(names), self.num_slots * self.multiple, *first.shape[1:])
        # Zeroed, not empty: the pool's pages are committed here, once. An empty pageable pool faults a page in
        # on the first save into each slot, inside a step: that save ran ~3x a memcpy (benchmarks/RESULTS.md).
        pool = torch.zeros(shape, dtype=first.dtype, pin_memory=self.pinned)
        self.pool = pool
        self._copier = BlockCopier(wide_rows(pool, 2))
        if on_device:
            self._stream = torch.cuda.Stream(device=first.device)
        logger.info(
            "offload pool: %d offloaded blocks, %.1f MiB of %s host memory, committed%s",
            self.num_slots,
            pool.numel() * pool.element_size() / 2**20,
            "pinned" if self.pinned else "pageable",
            "" if self.pinned or mode == "never" else " (no accelerator: pinning skipped)",
        )

    # ------------------------------------------------------------------- step

    def start_load_kv(self, metadata: OffloadMetadata) -> None:
        if self._copier is None:
            return
        if self._stream is not None and self._jobs:
            # The compute of this step may reuse device blocks a running save still reads.
            torch.cuda.current_stream(self._stream.device).wait_event(self._jobs[-1][2])
        self._finishing.update(metadata.delayed_frees)
        self._store_seq = metadata.store_seq
        with self._on_copy_stream():
            self._store_plans = self._plans(metadata.stores) if metadata.store_seq else []
        self._store_tags = {}
        self._saved_layers = set()
        for transfer in metadata.stores:
            self._last_store[transfer.req_id] = metadata.store_seq
            for slot, key in zip(transfer.slots, transfer.keys, strict=True):
                self._slot_keys.pop(slot, None)  # untrusted until the job completes
                self._store_tags[slot] = key
        if metadata.loads:
            self._start_loads(metadata.loads, metadata.load_seq)

    def _plans(self, transfers: list[BlockTransfer]) -> list[CopyPlan | None]:
        """One plan per KV-cache group, over all the transfers (call it on the copy stream)."""
        device = self._rows[0].device
        plans: list[CopyPlan | None] = []
        for g in range(len(self.context.kv_cache_groups)):
            dev = [b for t in transfers for b in t.device_blocks[g]]
            host = [b for t in transfers for b in t.host_blocks[g]]
            plans.append(CopyPlan.build(dev, host, device) if dev else None)
        return plans

    def _start_loads(self, transfers: list[BlockTransfer], sync_seq: int) -> None:
        """Copy every request's loaded blocks in one batch; each load completes with the batch's event.

        Sync loads (``sync_seq > 0``) are this step's: its compute waits for
        the copies (on CPU they are already done), and they end with the step.
        """
        assert self._copier is not None
        for transfer in transfers:
            self._drop_stale(transfer)
        with self._on_copy_stream():
            plans = self._plans(transfers)
            for layer, rows in enumerate(self._rows):
                plan = plans[self._group_of[layer]]
                if plan is not None:
                    self._copier.load(layer, rows, plan)
            self._count("loaded", plans)
            event = self._record()
        if not sync_seq:
            self._loads.extend(_Load(transfer.req_id, event) for transfer in transfers)
            return
        if event is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(event)
        self._loads_done = sync_seq

    def _drop_stale(self, transfer: BlockTransfer) -> None:
        """Remove the blocks of slots not holding their key (evicted, overwritten, never stored): load errors."""
        self._errors.update(transfer.failed_blocks)
        stale = {
            slot for slot, key in zip(transfer.slots, transfer.keys, strict=True) if self._slot_keys.get(slot) != key
        }
        if not stale:
            return
        for g, (dev, host) in enumerate(zip(transfer.device_blocks, transfer.host_blocks, strict=True)):
            bad = [h // self.multiple in stale for h in host]
            self._errors.update(d for d, b in zip(dev, bad, strict=True) if b)
            transfer.device_blocks[g] = [d for d, b in zip(dev, bad, strict=True) if not b]
            transfer.host_blocks[g] = [h for h, b in zip(host, bad, strict=True) if not b]

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._store_seq or self._copier is None:
            return
        layer = self._layers[layer_name]
        plan = self._store_plans[self._group_of[layer]]
        if plan is None:
            return
        if self._stream is not None:
            with self._on_copy_stream():  # after the compute stream wrote the layer
                self._copier.save(layer, self._rows[layer], plan)
        self._saved_layers.add(layer)

    def wait_for_save(self) -> None:
        """Close this step's store job; its copies may still run (CUDA).

        The job's slots are trusted only if every layer that had blocks to
        save was copied; otherwise the job still completes (so delayed frees
        proceed) but trusts nothing and counts nothing.
        """
        if not self._store_seq:
            return
        if self._stream is None and self._copier is not None:  # CPU: the layers' saves, back to back
            for layer in sorted(self._saved_layers):
                plan = self._store_plans[self._group_of[layer]]
                assert plan is not None, "save_kv_layer notes only layers with blocks to save"
                self._copier.save(layer, self._rows[layer], plan)
        needed = {layer for layer, g in enumerate(self._group_of) if self._store_plans[g] is not None}
        tags = self._store_tags
        if needed <= self._saved_layers:
            self._count("saved", self._store_plans)
        else:
            logger.warning(
                "offload: store job %d: save_kv_layer did not run for %d of %d layers after start_load_kv; "
                "its %d blocks are not kept (the engine broke kvconn's worker step order)",
                self._store_seq,
                len(needed - self._saved_layers),
                len(needed),
                len(tags),
            )
            tags = {}
        with self._on_copy_stream():
            self._jobs.append((self._store_seq, tags, self._record()))
        self._store_seq = 0

    def _count(self, what: str, plans: list[CopyPlan | None]) -> None:
        sizes = [(len(p), self._block_bytes[g]) for g, p in enumerate(plans) if p is not None]
        self._stats[f"blocks_{what}"] = self._stats.get(f"blocks_{what}", 0) + sum(n for n, _ in sizes)
        self._stats[f"bytes_{what}"] = self._stats.get(f"bytes_{what}", 0) + sum(n * b for n, b in sizes)

    def get_finished(self) -> tuple[set[str], set[str]]:
        while self._jobs and _done(self._jobs[0][2]):
            self._done_seq, tags, _ = self._jobs.popleft()
            self._slot_keys.update(tags)
        self._last_store = {r: seq for r, seq in self._last_store.items() if seq > self._done_seq}
        sending = {r for r in self._finishing if r not in self._last_store}
        self._finishing -= sending
        recving = {load.req_id for load in self._loads if _done(load.event)}
        self._loads = [load for load in self._loads if load.req_id not in recving]
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float]:
        stats, self._stats = self._stats, {}
        stats[STORES_DONE_STAT] = self._done_seq
        if self._loads_done:
            stats[LOADS_DONE_STAT] = self._loads_done
        if self._report_slots and self._copier is not None:
            stats[POOL_SLOTS_STAT] = self.num_slots
            stats[BLOCKING_COPIES_STAT] = float(self._stream is None)
            self._report_slots = False
        return stats

    def get_num_tracked_requests(self) -> int:
        return len(set(self._last_store) | self._finishing | {load.req_id for load in self._loads})

    def shutdown(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self.pool = None
        self._copier = None
        self._rows = []

    # ------------------------------------------------------------------- CUDA

    def _on_copy_stream(self) -> Any:
        """A context that issues work on the copy stream, ordered after all compute issued so far (CUDA)."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    def _record(self) -> Any:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


def _done(event: Any) -> bool:
    return event is None or bool(event.query())
