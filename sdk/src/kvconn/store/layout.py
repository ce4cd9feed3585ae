"""How a store value is laid out over one KV-cache group's tensors, and the staging memory loads land in.

Apart from :mod:`kvconn.store.worker` (which decides what a step loads and
saves, and when) because this is the byte-moving half: gather a group's
blocks into values, scatter verified values back, hand out views for in-place
reads and writes, and reuse staging buffers across steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy
import torch

from .integrity import HEADER_BYTES, layout_digest

__all__ = ["GroupLayout", "StagingBuffers", "byte_rows"]


class GroupLayout:
    """One KV-cache group's tensors, and how a block of it is laid out in a value.

    Host tensors whose blocks are contiguous are moved with one copy per byte
    (into the value's columns: ``numpy.take`` for small blocks, a copy per
    block for large ones; a fancy-indexed store back); others (a device, a
    strided layout) through torch, with one more.
    """

    #: Block bytes (one layer) from which a save copies block by block: ``numpy.take`` into the values'
    #: strided columns runs at half the speed of per-block copies from 8 KiB blocks up (4 KiB: even).
    ROW_COPY_BYTES = 8192

    def __init__(self, names: Sequence[str], tensors: Sequence[Any]) -> None:
        self.tensors = list(tensors)
        self.num_blocks = min(t.shape[0] for t in tensors)
        self.sizes = [t[0].numel() * t.element_size() for t in tensors]
        self.value_bytes = sum(self.sizes)
        layers = [(name, tuple(t.shape[1:]), str(t.dtype)) for name, t in zip(names, tensors, strict=True)]
        self.digest = layout_digest(layers)
        #: per layer, its blocks as rows of bytes (a view of the tensor), where that takes no copy
        self._rows = [
            t.view(t.shape[0], -1).view(torch.uint8).numpy() if t.device.type == "cpu" and t.is_contiguous() else None
            for t in tensors
        ]
        #: the same, flat, for views of one block without numpy's indexing (see :meth:`parts`)
        self._flat = [memoryview(rows).cast("B") for rows in self._rows if rows is not None]

    def _columns(self, rows: Any) -> Iterator[tuple[Any, Any, Any]]:
        """Per layer: its tensor, its byte rows (or ``None``), and its columns of the values ``rows``."""
        offset = HEADER_BYTES
        for t, layer_rows, size in zip(self.tensors, self._rows, self.sizes, strict=True):
            yield t, layer_rows, rows[:, offset : offset + size]
            offset += size

    def gather(self, block_ids: list[int], rows: Any) -> None:
        """Copy the blocks' bytes into ``rows`` (uint8 numpy, one row per block, payload from ``HEADER_BYTES``)."""
        ids = numpy.asarray(block_ids)
        for t, layer_rows, columns in self._columns(rows):
            if layer_rows is not None and columns.shape[1] >= self.ROW_COPY_BYTES:
                for i, block in enumerate(block_ids):
                    columns[i] = layer_rows[block]
            elif layer_rows is not None:
                numpy.take(layer_rows, ids, axis=0, out=columns, mode="clip")  # ids are in range: no clipping
            else:
                blocks = t.index_select(0, torch.from_numpy(ids).to(t.device)).view(len(block_ids), -1)
                torch.from_numpy(columns).copy_(blocks.view(torch.uint8).cpu())

    @property
    def in_place(self) -> bool:
        """Whether every layer's blocks can be read in place (host memory, one contiguous row a block)."""
        return all(rows is not None for rows in self._rows)

    def parts(self, block_id: int) -> list[memoryview]:
        """Block ``block_id``'s bytes in each layer, as views of the KV caches (only when :attr:`in_place`)."""
        return [
            flat[block_id * size : (block_id + 1) * size] for flat, size in zip(self._flat, self.sizes, strict=True)
        ]

    def scatter(self, block_ids: list[int], rows: Any) -> None:
        """Copy verified payload rows (uint8 numpy, one row per block, from ``HEADER_BYTES``) into ``block_ids``."""
        ids = numpy.asarray(block_ids)
        for t, layer_rows, columns in self._columns(rows):
            if layer_rows is not None:
                layer_rows[ids] = columns
            else:
                src = torch.from_numpy(columns).view(t.dtype).view(len(block_ids), *t.shape[1:])
                t.index_copy_(0, torch.from_numpy(ids).to(t.device), src.to(t.device))


class StagingBuffers:
    """Staging memory reused from step to step: fresh memory costs a page fault a page, more than the copy.

    A buffer comes back only once no store call can touch it any more: never
    after a call that missed its deadline (it may still read or write it).
    """

    KEEP = 4

    def __init__(self) -> None:
        self._free: list[bytearray] = []

    def take(self, size: int) -> bytearray:
        for i, buffer in enumerate(self._free):
            if len(buffer) >= size:
                return self._free.pop(i)
        return bytearray(size)

    def give(self, buffers: Sequence[bytearray]) -> None:
        self._free = sorted([*self._free, *buffers], key=len)[-self.KEEP :]


def byte_rows(buffer: bytearray, n: int, stride: int) -> Any:
    """The first ``n`` rows of ``stride`` bytes of ``buffer``, as a uint8 numpy array (no copy)."""
    return numpy.frombuffer(buffer, dtype=numpy.uint8, count=n * stride).reshape(n, stride)
