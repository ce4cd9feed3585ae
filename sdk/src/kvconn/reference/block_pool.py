"""The pool of KV-cache blocks: ref counts, LRU free queue, prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..context import NULL_BLOCK_ID

__all__ = ["Block", "BlockPool"]


class Block:
    """One physical block. ``block_hash`` is set once its KV is computed and cached."""

    __slots__ = ("block_hash", "block_id", "group", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group = -1

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Blocks ``1..num_blocks-1`` (block 0 is the null block, never handed out).

    Free blocks wait in LRU order; a free block that still has a hash remains a
    prefix-cache hit until it is reused, which evicts it from the index.

    ``on_free`` (opt-in, ``None`` by default) is called with the ids of the
    blocks each :meth:`free` call released: a test engine uses it to overwrite
    them at once, as a busy GPU cache would, so that anything still reading a
    freed block reads garbage.
    """

    on_free: Callable[[list[int]], None] | None = None

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[tuple[int, bytes], Block] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (caller checked room)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on (cached) blocks, removing free ones from the queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching zero join the queue tail in the given order."""
        released = []
        for block in blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                released.append(block.block_id)
        if released and self.on_free is not None:
            self.on_free(released)

    def lookup(self, group: int, block_hash: bytes) -> Block | None:
        return self._cached.get((group, block_hash))

    def cache(self, group: int, block: Block, block_hash: bytes) -> None:
        """Index a computed block; an existing block with the same hash is kept."""
        if block.block_hash is not None or (group, block_hash) in self._cached:
            return
        block.block_hash, block.group = block_hash, group
        self._cached[(group, block_hash)] = block

    def uncache(self, block: Block) -> None:
        """Drop a block from the prefix index (its contents are not to be trusted)."""
        self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self._cached.get((block.group, block.block_hash)) is block:
                del self._cached[(block.group, block.block_hash)]
            block.block_hash, block.group = None, -1
