"""Worker side of a store connector: blocks between the KV caches and the store.

A value is one block of one KV-cache group: the integrity header (see
:mod:`kvconn.store.integrity`) then the block's bytes in each of the group's
layers. A step is at most one batched ``get`` (from ``start_load_kv``) and one
batched ``put`` (in ``wait_for_save``, once every layer is computed).

A sync load lands in staging memory and is verified there (length, header,
key, layout, tag); only verified values are copied into the KV caches, by the
engine's thread, so a late store call can only write into its own staging. An
async load runs its ``get`` and the verification on the store's worker threads
and lands in ``get_finished`` of the step it is found done; one past its
deadline trips the store. When the store is a :class:`~kvconn.store.ScatterStore`
and the KV caches are host memory, an async load reads each value straight into
its blocks and verifies it there, no staging, no copy: safe because the request
waits (``WAITING_FOR_REMOTE_KVS``) until it is reported in ``get_finished``, and
nothing reads or writes its blocks till then (vLLM 0.33 holds an aborted
request's blocks until that report too, ``Scheduler.finish_requests``); a value
that fails verification is reported failed in that same report
(``get_block_ids_with_load_errors``: the engine recomputes the block, never
reading what the store wrote), and a get past its deadline is not reported until
it returns. A staged load past its deadline is abandoned at once.

With ``save_async`` a step's put runs on the store's worker threads while the
engine computes the next step. Its values are gathered into staging first (the
engine may free or reuse any block once the step ends: a held request's blocks
on this step's report, others on a preemption), so a held request is reported
in ``finished_sending`` as soon as its blocks are copied, and the put never
reads a KV cache. One put is in flight at a time: the next step's save, and
any step's load, wait for it within its deadline (bounded staging memory, and
a worker reads its own writes: the scheduler offers what it sent for saving
as stored until that put's deadline has passed, see
:class:`~kvconn.store.StoreScheduler`).

Nothing here raises into the engine: a failed load reports its blocks (the
engine recomputes them), a failed save is skipped; both are counted and logged
once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..context import NULL_BLOCK_ID, ConnectorContext
from .config import StoreConfig
from .guard import StoreUnavailable
from .integrity import HEADER_BYTES, Integrity
from .layout import GroupLayout, StagingBuffers, byte_rows
from .metadata import StoreBlock, StoreMetadata
from .protocol import BlockStore, PartsStore, ScatterStore
from .side import StoreSide
from .values import explain, judge, seal_parts

__all__ = ["StoreWorker"]


@dataclass
class _GroupLoad:
    """A step's loads of one group: distinct keys in staging, and the blocks each lands in."""

    layout: GroupLayout
    keys: list[bytes] = field(default_factory=list)
    targets: list[tuple[int, int]] = field(default_factory=list)  # (slot, block id)
    staging: bytearray = field(default_factory=bytearray)
    verdicts: list[str | None] = field(default_factory=list)

    @property
    def stride(self) -> int:
        return HEADER_BYTES + self.layout.value_bytes


@dataclass
class _Load:
    """One step's batched load: its groups, requests, and (async) the store call running it.

    ``in_place``: read straight into the blocks (no staging), so never reported before its store call returned.
    """

    groups: list[_GroupLoad]
    req_ids: set[str]
    in_place: bool = False
    started: float = field(default_factory=time.monotonic)
    future: Future[None] | None = None
    late: bool = False


@dataclass
class _Save:
    """A step's batched put in flight (``save_async``): its staged values' sizes, and the staging it reads."""

    future: Future[Sequence[bool]]
    sizes: list[int]
    buffers: list[bytearray]
    started: float = field(default_factory=time.monotonic)


class StoreWorker(StoreSide):
    """The worker side of every :class:`~kvconn.store.StoreConnector`."""

    def __init__(self, config: StoreConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.integrity = Integrity(config.integrity_secret)
        self._layouts: list[GroupLayout] = []
        self._metadata: StoreMetadata | None = None
        self._pending: list[_Load] = []
        self._errors: set[int] = set()
        self._recving: set[str] = set()
        self._buffers = StagingBuffers()
        self._saving: _Save | None = None
        #: the store last judged, and whether it is a PartsStore and a ScatterStore (see :meth:`_judge`)
        self._judged: tuple[BlockStore | None, bool, bool] = (None, False, False)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        layouts = []
        for g, spec in enumerate(self.context.kv_cache_groups):
            missing = [name for name in spec.layer_names if name not in kv_caches]
            if missing:
                raise ValueError(f"KV-cache group {g}: no KV-cache tensor for layers {missing}")
            layouts.append(GroupLayout(spec.layer_names, [kv_caches[name] for name in spec.layer_names]))
        self._layouts = layouts

    def _addressable(self, blocks: Sequence[StoreBlock]) -> tuple[Sequence[StoreBlock], list[StoreBlock]]:
        """The blocks this worker can address, and the rest (never touch memory out of range)."""
        ends = [layout.num_blocks for layout in self._layouts]
        groups = len(ends)
        bad = [b for b in blocks if not (0 <= b.group < groups and NULL_BLOCK_ID < b.block_id < ends[b.group])]
        return (blocks, bad) if not bad else ([b for b in blocks if b not in bad], bad)

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, metadata: StoreMetadata) -> None:
        self._metadata = metadata
        if not metadata.loads:
            return
        self.settle_saves()  # the scheduler may offer what a put in flight is saving: read this worker's writes
        blocks, bad = self._addressable(metadata.loads)
        self._fail([b.block_id for b in bad], "load_failed_unaddressable", "loads named blocks this worker lacks")
        groups = self._plan(blocks)
        in_place = metadata.load_async and self._in_place(groups)
        if not in_place:
            for group in groups:
                group.staging = self._buffers.take(len(group.keys) * group.stride)
        load = _Load(groups, {b.req_id for b in metadata.loads}, in_place)
        if not metadata.load_async:
            try:
                self.guard.call("get", lambda store: self._fetch(store, load))
            except StoreUnavailable:
                self._abandon(load, late=True)
                return
            self._land(load)
            return
        try:
            load.future = self.guard.submit("get", lambda store: self._fetch(store, load))
        except StoreUnavailable:
            self._abandon(load)
            self._recving |= load.req_ids
            return
        self._pending.append(load)

    def _plan(self, blocks: Sequence[StoreBlock]) -> list[_GroupLoad]:
        """One staging slot per distinct key: requests sharing a prefix load it into blocks of their own."""
        groups: dict[int, tuple[_GroupLoad, dict[bytes, int]]] = {}
        for b in blocks:
            if b.group not in groups:
                groups[b.group] = (_GroupLoad(self._layouts[b.group]), {})
            group, slots = groups[b.group]
            group.targets.append((slots.setdefault(b.block_hash, len(slots)), b.block_id))
        for g, (group, slots) in groups.items():
            group.keys = self.keys.keys(g, slots)
        return [group for group, _ in groups.values()]

    def _in_place(self, groups: Sequence[_GroupLoad]) -> bool:
        """Whether a load can read straight into its blocks: a ScatterStore, host KV caches, one block per key."""
        return self._judge()[2] and all(
            group.layout.in_place and len(group.targets) == len(group.keys) for group in groups
        )

    def _fetch(self, store: BlockStore, load: _Load) -> None:
        """Read every value (into staging, or in place) and verify it (on a store thread when async)."""
        if load.in_place:
            keys, parts = self._in_place_parts(load)
            lengths = list(store.get_parts(keys, parts))  # type: ignore[attr-defined]
            values: Sequence[tuple[memoryview, Sequence[memoryview]]] = [(p[0], p[1:]) for p in parts]
        else:
            keys = [key for group in load.groups for key in group.keys]
            views = [
                view[i * stride : (i + 1) * stride]
                for group in load.groups
                for view, stride in [(memoryview(group.staging), group.stride)]
                for i in range(len(group.keys))
            ]
            lengths = list(store.get(keys, views))
            values = [(view[:HEADER_BYTES], (view[HEADER_BYTES:],)) for view in views]
        if len(lengths) != len(keys):
            raise ValueError(f"the store returned {len(lengths)} answers for {len(keys)} keys")
        answers = iter(zip(lengths, values, strict=True))
        for group in load.groups:
            digest, size = group.layout.digest, group.layout.value_bytes
            for key in group.keys:
                length, (header, payload) = next(answers)
                group.verdicts.append(judge(self.integrity, key, digest, length, header, payload, size))

    def _in_place_parts(self, load: _Load) -> tuple[list[bytes], list[list[memoryview]]]:
        """Per value of an in-place load: its key, and its parts (a header of its own, its block's row per layer)."""
        headers = memoryview(bytearray(sum(len(group.keys) for group in load.groups) * HEADER_BYTES))
        keys: list[bytes] = []
        parts: list[list[memoryview]] = []
        for group in load.groups:
            for slot, block in group.targets:  # one block per key: slot i is targets[i]
                keys.append(group.keys[slot])
                parts.append([headers[len(parts) * HEADER_BYTES : (len(parts) + 1) * HEADER_BYTES]])
                parts[-1] += group.layout.parts(block)
        return keys, parts

    def _land(self, load: _Load) -> None:
        """Copy the verified values of a fetched load into the KV caches (in place: there already); report the rest."""
        moved = landed = 0
        for group in load.groups:
            ok = [(slot, block) for slot, block in group.targets if group.verdicts[slot] is None]
            failed: dict[str, list[int]] = {}
            for slot, block in group.targets:
                if (verdict := group.verdicts[slot]) is not None:
                    failed.setdefault(verdict, []).append(block)
            for reason, ids in failed.items():
                self._fail(ids, f"load_failed_{reason}", _why(reason))
            if ok and not load.in_place:
                rows = byte_rows(group.staging, len(group.keys), group.stride)
                if len(ok) < len(group.targets) or len(group.keys) < len(ok):
                    rows = rows[[slot for slot, _ in ok]]  # only the verified values, one row per block
                group.layout.scatter([block for _, block in ok], rows)
            landed += len(ok)
            moved += len(ok) * group.layout.value_bytes
        self.stats.count("blocks_loaded", landed)
        self.stats.count("bytes_loaded", moved)
        if not load.in_place:
            self._buffers.give([group.staging for group in load.groups])

    def _abandon(self, load: _Load, *, late: bool = False) -> None:
        """Fail every block of ``load``; its staging is reused unless a ``late`` store call may still write it."""
        if not late and not load.in_place:
            self._buffers.give([group.staging for group in load.groups])
        ids = [block for group in load.groups for _, block in group.targets]
        self._fail(ids, "load_failed_store_off", "loads failed (the store is off, late or raised); recomputed")

    def _fail(self, block_ids: Sequence[int], kind: str, explanation: str) -> None:
        self._errors.update(block_ids)
        self.stats.degraded(kind, len(block_ids), explanation)

    # ------------------------------------------------------------------ saves

    def wait_for_save(self) -> None:
        """Save this step's blocks, each sealed, in one batched write-once put within the deadline.

        Through staging (gathered, then sealed in place), or, when the store
        is a :class:`~kvconn.store.PartsStore` and the KV caches are host
        memory, straight from the KV caches (:meth:`_save_in_place`). With
        ``save_async``, always through staging, and the put is only started
        here (see the module docstring).
        """
        metadata = self._metadata
        if metadata is None or not metadata.saves:
            return
        blocks, bad = self._addressable(metadata.saves)
        self.stats.degraded("save_failed_unaddressable", len(bad), "saves named blocks this worker lacks")
        by_group: dict[int, dict[bytes, int]] = {}
        for b in blocks:
            by_group.setdefault(b.group, {}).setdefault(b.block_hash, b.block_id)  # a prefix computed twice: once
        if not self.config.save_async and self._judge()[1] and all(self._layouts[g].in_place for g in by_group):
            self._save_in_place(by_group)
            return
        self.settle_saves()  # the last step's put, if still in flight: one at a time
        keys: list[bytes] = []
        values: list[memoryview] = []
        buffers: list[bytearray] = []
        for g, ids in by_group.items():
            layout = self._layouts[g]
            stride = HEADER_BYTES + layout.value_bytes
            buffers.append(staging := self._buffers.take(len(ids) * stride))
            layout.gather(list(ids.values()), byte_rows(staging, len(ids), stride))
            view = memoryview(staging)
            for i, block_hash in enumerate(ids):
                key = self.keys.key(g, block_hash)
                value = view[i * stride : (i + 1) * stride]
                value[:HEADER_BYTES] = self.integrity.seal(key, layout.digest, value[HEADER_BYTES:])
                keys.append(key)
                values.append(value)
        sizes = [len(v) - HEADER_BYTES for v in values]
        if not self.config.save_async:
            if self._put(lambda store: store.put(keys, values), sizes):
                self._buffers.give(buffers)  # else dropped: a late put may still be reading them
            return
        try:
            self._saving = _Save(self.guard.submit("put", lambda store: store.put(keys, values)), sizes, buffers)
        except StoreUnavailable:
            self._save_off(sizes)
            self._buffers.give(buffers)  # no put started: nothing reads them

    def _judge(self) -> tuple[BlockStore | None, bool, bool]:
        """The store, whether it is a :class:`~kvconn.store.PartsStore` and a :class:`~kvconn.store.ScatterStore`.

        Judged once per store opened: a protocol ``isinstance`` walks the protocol's attributes on every call,
        too slow for every step.
        """
        store = self.guard.store
        if store is not self._judged[0]:
            self._judged = (store, isinstance(store, PartsStore), isinstance(store, ScatterStore))
        return self._judged

    def _save_in_place(self, by_group: Mapping[int, Mapping[bytes, int]]) -> None:
        """Save straight from the KV caches: per value, its header, then the block's row in each layer.

        No staging copy. The tags are taken before the put: if a put past its
        deadline still reads a block the engine has changed since, the value it
        stores fails verification, and never loads.
        """
        keys: list[bytes] = []
        parts: list[list[memoryview]] = []
        sizes: list[int] = []
        for g, ids in by_group.items():
            layout = self._layouts[g]
            group_keys = self.keys.keys(g, ids)
            payloads = [layout.parts(b) for b in ids.values()]
            parts += seal_parts(self.integrity, group_keys, layout.digest, payloads, layout.value_bytes)
            keys += group_keys
            sizes += [layout.value_bytes] * len(group_keys)
        self._put(lambda store: store.put_parts(keys, parts), sizes)  # type: ignore[attr-defined]

    def _put(self, put: Callable[[BlockStore], Sequence[bool]], sizes: Sequence[int]) -> bool:
        """One batched put within the deadline (value ``i`` holds ``sizes[i]`` payload bytes), counted; False: off."""
        try:
            stored = self.guard.call("put", put)
        except StoreUnavailable:
            self._save_off(sizes)
            return False
        self._saved(sizes, stored)
        return True

    def _settle_save(self, *, wait: bool) -> None:
        """Count the put in flight once it returned (``wait``: within what is left of its deadline).

        One that raised, or is past its deadline, trips the store; its staging
        is dropped then, as a late put may still read it.
        """
        save = self._saving
        assert save is not None
        left = self.config.timeout_s - (time.monotonic() - save.started)
        if not (wait or save.future.done() or left <= 0):
            return
        self._saving = None
        try:
            stored = self.guard.result("put", save.future, timeout=max(left, 0.0))
        except StoreUnavailable:
            self._save_off(save.sizes)
            return
        self._saved(save.sizes, stored)
        self._buffers.give(save.buffers)

    def _save_off(self, sizes: Sequence[int]) -> None:
        self.stats.degraded("save_failed_store_off", len(sizes), "saves failed (the store is off, late or raised)")

    def _saved(self, sizes: Sequence[int], stored: Sequence[bool]) -> None:
        """Count a put's answers: value ``i`` held ``sizes[i]`` payload bytes."""
        saved = [size for size, ok in zip(sizes, stored, strict=True) if ok]
        self.stats.count("blocks_saved", len(saved))
        self.stats.count("bytes_saved", sum(saved))
        self.stats.degraded("save_failed_refused", len(sizes) - len(saved), "the store refused values (full?)")

    def settle_saves(self) -> None:
        """Wait for the put in flight (``save_async``), within its deadline, and count it.

        For tools and tests that read the store or :attr:`stats` right after a
        step: with ``save_async`` the step's put may still be running, so they
        would see the store as it was before it. A no-op without a put in flight.
        """
        if self._saving is not None:
            self._settle_save(wait=True)

    def shutdown(self) -> None:
        """Let the put in flight land (within its deadline), then close the store: a clean stop loses no save."""
        self.settle_saves()
        super().shutdown()

    # ---------------------------------------------------------------- reports

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Held requests whose saves ran this step, and async loads that landed (or were abandoned)."""
        metadata, self._metadata = self._metadata, None
        sending = set(metadata.finished_saves) if metadata is not None else set()
        if self._saving is not None:
            self._settle_save(wait=False)
        if not self._pending and not self._recving:
            return sending, set()
        still: list[_Load] = []
        for load in self._pending:
            assert load.future is not None
            if load.future.done():
                try:
                    self.guard.result("get", load.future)
                except StoreUnavailable:
                    self._abandon(load)
                else:
                    self._land(load)
            elif time.monotonic() - load.started > self.config.timeout_s and not load.late:
                self.guard.trip(f"a get did not answer within {self.config.timeout_s:g} s")
                if load.in_place:  # it may still write into the blocks: the request waits until it returns
                    load.late = True
                    still.append(load)
                    continue
                self._abandon(load, late=True)
            else:
                still.append(load)
                continue
            self._recving |= load.req_ids
        self._pending = still
        recving, self._recving = self._recving, set()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, float]:
        return self.stats.take()

    def get_num_tracked_requests(self) -> int:
        return len({req_id for load in self._pending for req_id in load.req_ids} | self._recving)


def _why(reason: str) -> str:
    instead = "it is recomputed" if reason == "missing" else "the block is recomputed"
    return explain(reason, unit="block", layout="KV layout", lands_in="the KV cache", instead=instead)
