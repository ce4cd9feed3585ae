"""A vLLM connector's metadata as the plain data kvconn's block-id analysis reads (:func:`plain_view`).

A kvconn plugin's metadata is a msgspec Struct; a vLLM connector's is any object. The checks that look for block
ids in metadata (stale tables, blocks of other requests) read this view of it instead. Read by
:mod:`.native_observer`; a vLLM metadata type the analysis should read differently is taught here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = ["plain_view"]


def plain_view(obj: object, block_size: int) -> object:
    """``obj`` as the plain data the block-id analysis reads: dataclasses and objects as dicts, tensors as lists.

    A field named for slots (vLLM's ``slot_mapping``) holds ``block * block_size + offset``: it becomes the block
    ids it covers, so the checks compare them with the live tables. vLLM's KV-offloading specs are read by type
    (:func:`_offloading_spec`).
    """
    return _plain(obj, block_size, "", set())


def _offloading_spec(obj: object) -> dict[str, Any] | None:
    """A spec of vLLM's KV offloading (``vllm.v1.kv_offload.base.LoadStoreSpec``) as plain data; ``None`` if not one.

    ``GPULoadStoreSpec.block_ids`` are the engine's blocks (its ``block_indices``, each group's position in the
    request, become ``first_block_index``); any other spec addresses the offloaded medium (``CPULoadStoreSpec``:
    chunks of the CPU cache), so its ids become ``offloaded_chunk_index``, which the block-id analysis leaves out.
    """
    names = {(k.__module__, k.__name__) for k in type(obj).__mro__}
    base = "vllm.v1.kv_offload.base"
    if (base, "LoadStoreSpec") not in names:
        return None
    ids = getattr(obj, "block_ids", None)
    if (base, "GPULoadStoreSpec") not in names:
        return {"offloaded_chunk_index": ids}
    return {"block_ids": ids, "group_sizes": obj.group_sizes, "first_block_index": obj.block_indices}  # type: ignore[attr-defined]


def _plain(obj: object, block_size: int, name: str, seen: set[int]) -> object:
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if id(obj) in seen:
        return None
    seen = seen | {id(obj)}
    tolist = getattr(obj, "tolist", None)
    if callable(tolist) and type(obj).__module__.startswith(("torch", "numpy")):
        obj = tolist()
        if "slot" in name and isinstance(obj, list) and all(isinstance(i, int) for i in obj):
            return sorted({i // block_size for i in obj})
        return obj if not isinstance(obj, list) else [_plain(i, block_size, name, seen) for i in obj]
    if isinstance(obj, Mapping):
        return {
            k if isinstance(k, (str, int)) else repr(k): _plain(v, block_size, str(k), seen) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(i, block_size, name, seen) for i in obj]
    spec = _offloading_spec(obj)
    if spec is not None:
        return _plain(spec, block_size, name, seen)
    if is_dataclass(obj) and not isinstance(obj, type):
        items = {f.name: getattr(obj, f.name) for f in fields(obj)}
    else:
        items = {k: v for k, v in vars(obj).items() if not k.startswith("_")} if hasattr(obj, "__dict__") else {}
    return {k: _plain(v, block_size, k, seen) for k, v in items.items()}
