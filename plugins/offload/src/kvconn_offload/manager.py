"""Scheduler-side bookkeeping of the host pool: which block hash lives in which slot.

A *slot* holds one offloaded block (``block_size_multiple`` engine blocks, all
layers). Entries are keyed by the chained hash of their last engine block, so a
key names the whole prefix up to it. An entry is *pending* from
``prepare_store`` until ``complete_store``, and *pinned* while loads read it;
eviction (LRU or FIFO) only takes ready, unpinned entries, so no slot is
rewritten while a copy still reads or writes it.

Once :meth:`record_changes` was called, the keys that became loadable and those
dropped are kept until :meth:`take_changes` (the KV-cache events of an engine
that publishes them); until then nothing is kept.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["Entry", "OffloadManager"]


@dataclass
class Entry:
    """One offloaded block. ``valid[g]`` has bit ``j`` set when engine sub-block ``j`` of group ``g`` was saved."""

    slot: int
    ready: bool = False
    pins: int = 0
    valid: list[int] = field(default_factory=list)


class OffloadManager:
    """Slots ``0..num_slots-1`` over block hashes, with LRU (or FIFO) eviction."""

    def __init__(self, num_slots: int, *, policy: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if policy not in ("lru", "fifo"):
            raise ValueError(f"eviction policy must be 'lru' or 'fifo', not {policy!r}")
        self.num_slots = num_slots
        self.policy = policy
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # eviction order: first = next victim
        self._free: list[int] = list(range(num_slots))  # a heap: lowest slots first keeps stores contiguous
        self.evictions = 0
        self._stored: list[bytes] | None = None  # None: changes are not recorded (no engine takes them)
        self._removed: list[bytes] = []

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def lookup(self, keys: Iterable[bytes]) -> int:
        """How many leading ``keys`` are ready to load (no side effects)."""
        n = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                break
            n += 1
        return n

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark ``keys`` as just used (LRU); FIFO ignores use."""
        if self.policy != "lru":
            return
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def prepare_store(self, keys: Sequence[bytes]) -> list[tuple[bytes, Entry]]:
        """Reserve slots for the ``keys`` not yet offloaded, evicting as needed.

        Stops at the first key that finds no room (every slot pending or
        pinned): later blocks are useless without it for a prefix lookup.
        Returns the new (pending) entries in order.
        """
        new: list[tuple[bytes, Entry]] = []
        for key in keys:
            if key in self._entries:
                continue
            slot = self._take_slot()
            if slot is None:
                break
            entry = Entry(slot)
            self._entries[key] = entry
            new.append((key, entry))
        return new

    def complete_store(self, keys: Iterable[bytes], *, success: bool = True) -> None:
        """Stores of ``keys`` ended: they become loadable, or are dropped if they failed."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if success:
                entry.ready = True
                if self._stored is not None:
                    self._stored.append(key)
            else:
                del self._entries[key]
                heapq.heappush(self._free, entry.slot)

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop ready ``keys`` whose slots turned out not to hold them; a key another load still pins stays."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.ready and entry.pins == 0:
                del self._entries[key]
                heapq.heappush(self._free, entry.slot)
                self._note_removed(key)

    def prepare_load(self, keys: Iterable[bytes]) -> None:
        """Pin ready entries a load is about to read (never evicted until ``complete_load``)."""
        for key in keys:
            self._entries[key].pins += 1

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def _take_slot(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for key, entry in self._entries.items():
            if entry.ready and entry.pins == 0:
                del self._entries[key]
                self.evictions += 1
                self._note_removed(key)
                return entry.slot
        return None

    def _note_removed(self, key: bytes) -> None:
        if self._stored is not None:
            self._removed.append(key)

    def record_changes(self) -> None:
        """Keep the keys stored and removed from now on, for :meth:`take_changes`."""
        if self._stored is None:
            self._stored = []

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The keys that became loadable and those dropped since the last call, in that order."""
        self.record_changes()
        assert self._stored is not None
        changes = self._stored, self._removed
        self._stored, self._removed = [], []
        return changes
