"""An SGLang host pool's pages as byte views, in place: what a value's payload is read from and written to.

SGLang's host pools say where a page lives through ``get_page_buffer_meta``
(per page, the address and size of each of its pieces: K and V, per layer in
``layer_first``), the same description its zero-copy backends hand to their
transfer engines. Here each address becomes a view of the pool's own host
tensor, so a value's payload is the page's bytes in that order, with no copy
on the way to or from the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvconn.store.integrity import layout_digest

__all__ = ["PageViews"]

#: Host tensors a pool may keep its pages in (whichever it has).
_BUFFERS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


class PageViews:
    """Views of one host pool's pages; ``digest`` names their byte layout in every value's header."""

    def __init__(self, pool: Any) -> None:
        import torch

        self.pool = pool
        self.page_size = int(pool.page_size)
        regions: dict[int, tuple[int, memoryview]] = {}
        for name in _BUFFERS:
            tensors = getattr(pool, name, None)
            for t in tensors if isinstance(tensors, list | tuple) else [tensors]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                    flat = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")
                    regions.setdefault(t.data_ptr(), (t.data_ptr() + flat.nbytes, flat))
        if not regions:
            raise ValueError(f"{type(pool).__name__} keeps no contiguous host tensor kvconn can read pages from")
        # A tensor inside another (``k_buffer`` and ``v_buffer``, views of ``kv_buffer``) adds no bytes: dropped,
        # so that a pool with one host tensor takes the fast path of :meth:`pages`.
        self._regions: list[tuple[int, int, memoryview]] = []
        for start, (end, flat) in sorted(regions.items()):
            if not self._regions or end > max(region[1] for region in self._regions):
                self._regions.append((start, end, flat))
        probe = pool.get_page_buffer_meta(_page_indices(self.page_size))
        self.sizes = [int(size) for size in probe[1]]
        self.page_bytes = sum(self.sizes)
        layers = [(f"{pool.layout}.{i}", (size,), str(pool.dtype)) for i, size in enumerate(self.sizes)]
        self.digest = layout_digest(layers)

    def pages(self, host_indices: Any) -> list[list[memoryview]]:
        """Per page of ``host_indices`` (token slots, page-aligned), its pieces as views of the pool."""
        pointers, sizes = self.pool.get_page_buffer_meta(host_indices)
        per_page = len(self.sizes)
        start, end, flat = self._regions[0]
        if len(self._regions) == 1 and pointers and min(pointers) >= start and max(pointers) + max(sizes) <= end:
            # one host tensor holds every piece (each within it: the bounds above): slice it, nothing to search
            views = [flat[ptr - start : ptr - start + size] for ptr, size in zip(pointers, sizes, strict=True)]
        else:
            views = [self._view(int(ptr), int(size)) for ptr, size in zip(pointers, sizes, strict=True)]
        return [views[i : i + per_page] for i in range(0, len(views), per_page)]

    def _view(self, ptr: int, size: int) -> memoryview:
        for start, end, flat in self._regions:
            if start <= ptr and ptr + size <= end:
                return flat[ptr - start : ptr - start + size]
        raise ValueError(f"the host pool named a page piece at {ptr:#x} (+{size}) outside its host tensors")


def _page_indices(page_size: int) -> Any:
    import torch

    return torch.arange(page_size, dtype=torch.int64)


def page_count(host_indices: Any, page_size: int) -> int:
    """How many pages ``host_indices`` covers."""
    return len(host_indices) // page_size


def flat_views(tensors: Sequence[Any]) -> list[memoryview]:
    """Each tensor's bytes as one view (made contiguous on the host first)."""
    import torch

    return [memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).cast("B") for t in tensors]
