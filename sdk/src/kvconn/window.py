"""The sliding-window cut of a prefix hit, shared by every loading connector.

A hit of ``h`` blocks is loadable only if every block the engine will read
after it is stored: all of ``[start, h)`` for a full-attention group, but for
a sliding-window group only the blocks inside the window of position ``h``
(the engine allocates the null block for the ones before it, see
:meth:`~kvconn.KVCacheGroupSpec.first_needed_block`). A group that misses a
block inside its window therefore shortens the hit, while a miss before the
window does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .context import KVCacheGroupSpec

__all__ = ["loadable_hit", "window_blocks"]


def window_blocks(group: KVCacheGroupSpec, start: int, end: int, block_size: int) -> range:
    """The blocks of ``[start, end)`` that ``group`` reads once ``end`` blocks are computed."""
    return range(max(start, group.first_needed_block(end * block_size, block_size)), end)


def loadable_hit(
    groups: Sequence[KVCacheGroupSpec],
    block_size: int,
    start: int,
    end: int,
    present: Callable[[int, int], bool],
    *,
    step: int = 1,
) -> int:
    """The end of the longest hit in ``[start, end]`` every group can load.

    ``present(group, block)`` says whether the store holds that block of that
    group. The hit ends on a multiple of ``step`` blocks (a connector storing
    several engine blocks as one), and is ``start`` when nothing loads.
    """
    hit = end
    for g, group in enumerate(groups):
        if group.sliding_window is None:
            hit = next((i for i in range(start, hit) if not present(g, i)), hit)
    hit -= hit % step
    windowed = [(g, group) for g, group in enumerate(groups) if group.sliding_window is not None]
    while hit > start and not all(
        present(g, i) for g, group in windowed for i in window_blocks(group, start, hit, block_size)
    ):
        hit -= step
    return max(hit, start)
