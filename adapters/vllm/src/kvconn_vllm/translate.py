"""vLLM objects -> kvconn objects, at the adapter boundary and nowhere else.

Nothing here imports vLLM: the functions read vLLM objects by attribute, so
they are testable without vLLM and keep the adapter's import cheap.

What plugins see of vLLM:

* a request as :class:`VllmRequestView` (:class:`kvconn.ConnectorRequest`):
  vLLM's own ``block_hashes`` (bytes, one per full block at the cache block
  size). vLLM hashes with its configured algorithm (SHA-256 over pickled
  ``(parent, tokens, extra_keys)`` by default), not :mod:`kvconn.hashing`:
  keys are stable within one engine and across engines with the same vLLM
  hashing settings, but do not match blocks saved by the reference engine.
* a ``kvconn.SchedulerOutput`` built from vLLM's (:func:`translate_scheduler_output`)
  at a cost that does not grow with the batch: read-only views over vLLM's
  lists (:class:`ListView`, :class:`NewBlockIdsView`), nothing copied that no
  plugin reads;
* vLLM's own KV-cache tensors, checked (:func:`check_kv_caches`), with
  ``ConnectorContext.kv_layout == "vllm-BHNC"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from itertools import repeat
from types import MappingProxyType
from typing import Any, TypeVar, overload

from kvconn.block_state import BlockIds
from kvconn.context import ConnectorContext, KVCacheGroupSpec
from kvconn.errors import ConnectorConfigError
from kvconn.outputs import CachedRequestData, NewRequestData, SchedulerOutput

__all__ = [
    "ListView",
    "NewBlockIdsView",
    "Repeat",
    "VllmRequestView",
    "context_from_vllm",
    "VLLM_KV_LAYOUT",
    "check_kv_caches",
    "to_block_ids",
    "translate_scheduler_output",
]


T = TypeVar("T")

#: ``ConnectorContext.kv_layout`` under vLLM: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``.
VLLM_KV_LAYOUT = "vllm-BHNC"


class VllmRequestView:
    """A vLLM ``Request`` as a :class:`kvconn.ConnectorRequest` (read-through, live).

    ``num_computed_tokens`` can be pinned: when vLLM calls
    ``update_state_after_alloc`` it has not yet set the request's count, and
    kvconn's contract says external tokens start at ``num_computed_tokens``.
    """

    __slots__ = ("_num_computed_tokens", "_request")

    def __init__(self, request: Any, num_computed_tokens: int | None = None) -> None:
        self._request = request
        self._num_computed_tokens = num_computed_tokens

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> Sequence[int]:
        return self._request.prompt_token_ids or []

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._request.all_token_ids

    @property
    def num_tokens(self) -> int:
        return int(self._request.num_tokens)

    @property
    def num_computed_tokens(self) -> int:
        if self._num_computed_tokens is not None:
            return self._num_computed_tokens
        return int(self._request.num_computed_tokens)

    @property
    def block_hashes(self) -> Sequence[bytes]:
        return self._request.block_hashes

    def __repr__(self) -> str:
        return f"VllmRequestView({self.request_id!r}, num_computed_tokens={self.num_computed_tokens})"


def to_block_ids(tables: Sequence[Sequence[int]]) -> BlockIds:
    """A fresh ``tuple[list[int], ...]`` of vLLM's block ids (plugins may keep or mutate it safely)."""
    return tuple(map(list, tables))


def _copy_entry(tables: BlockIds | None) -> BlockIds | None:
    return None if tables is None else tuple(map(list, tables))


class _ReadOnlySequence(Sequence[T]):
    """What plugins get in place of a list: equal to any sequence of the same items, unhashable like a list."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class ListView(_ReadOnlySequence[T]):
    """One of vLLM's lists as plugins see it: read-only, made in O(1), nothing copied.

    Why a view: vLLM sends its ``SchedulerOutput`` to its workers after the
    connectors ran, so a plugin must not be able to change it; and copying a
    list of every scheduled request each step costs kvconn time that grows
    with the batch (each copy touches every element), whether a plugin reads
    it or not.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Sequence[T]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return list(self._items[index])
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __contains__(self, value: object) -> bool:
        return value in self._items


class NewBlockIdsView(ListView["BlockIds | None"]):
    """vLLM's ``CachedRequestData.new_block_ids``: a :class:`ListView` whose entries are copied when read.

    Entries hold vLLM's own block-id lists, so a read returns a fresh
    ``tuple[list[int], ...]`` (or ``None``: no block allocated this step), which
    the plugin may keep or change; nothing is copied for entries nobody reads
    (most plugins read tables from the block state and never look here).
    """

    __slots__ = ()

    @overload
    def __getitem__(self, index: int) -> BlockIds | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[BlockIds | None]: ...

    def __getitem__(self, index: int | slice) -> BlockIds | list[BlockIds | None] | None:
        if isinstance(index, slice):
            return [_copy_entry(e) for e in self._items[index]]
        return _copy_entry(self._items[index])

    def __iter__(self) -> Iterator[BlockIds | None]:
        return map(_copy_entry, self._items)


class Repeat(_ReadOnlySequence[T]):
    """``n`` times one value, made in O(1), read-only: the usual step's per-request flags and token lists.

    vLLM sends no per-request token lists and no resumed flags on most steps;
    building ``[False] * n`` each step would cost time that grows with the batch.
    """

    __slots__ = ("_n", "_value")

    def __init__(self, value: T, n: int) -> None:
        self._value, self._n = value, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._value] * len(range(*index.indices(self._n)))
        if not -self._n <= index < self._n:
            raise IndexError(f"index {index} out of range for {self._n} requests")
        return self._value

    def __iter__(self) -> Iterator[T]:
        return repeat(self._value, self._n)

    def __contains__(self, value: object) -> bool:
        return self._n > 0 and value == self._value


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def context_from_vllm(
    vllm_config: Any, kv_cache_config: Any, *, tp_rank: int = 0, kv_layout: str = VLLM_KV_LAYOUT
) -> ConnectorContext:
    """The :class:`kvconn.ConnectorContext` of a vLLM engine.

    Model, KV dtype (``cache_dtype`` when it is not ``"auto"``), block size,
    KV-cache groups (layer names; sliding window in tokens for sliding-window
    specs), one layer's KV shape, TP rank/size and engine id. Groups of another block size than the
    cache's (state-space layers) are refused with :class:`ConnectorConfigError`.
    """
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    vllm_groups = getattr(kv_cache_config, "kv_cache_groups", ()) or ()
    block_size = int(cache_config.block_size)
    sizes = {int(getattr(g.kv_cache_spec, "block_size", block_size)) for g in vllm_groups}
    if sizes - {block_size}:
        raise ConnectorConfigError(
            f"vLLM's KV-cache groups use block sizes {sorted(sizes)} (cache block size {block_size}); kvconn "
            "connectors need one block size for every group, as attention-only models have (state-space "
            "layers are not supported): remove kv_transfer_config for this model"
        )
    groups = tuple(
        KVCacheGroupSpec(tuple(group.layer_names), getattr(group.kv_cache_spec, "sliding_window", None))
        for group in vllm_groups
    )
    optional: dict[str, Any] = {"kv_cache_groups": groups} if groups else {}
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
    if engine_id:
        optional["engine_id"] = str(engine_id)
    if vllm_groups:  # one layer's KV shape on this worker (vLLM's specs are per rank)
        spec = vllm_groups[0].kv_cache_spec
        optional["num_kv_heads"] = int(spec.num_kv_heads)
        optional["head_dim"] = int(spec.head_size)
    return ConnectorContext(
        model=str(model_config.model),
        dtype=cache_dtype if cache_dtype != "auto" else _dtype_name(model_config.dtype),
        block_size=block_size,
        kv_layout=kv_layout,
        tp_rank=tp_rank,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        **optional,
    )


@lru_cache(maxsize=8)
def _none_resumed(n: int) -> Repeat[bool]:
    """The usual step's resumed flags: read-only, so one per batch size serves every step."""
    return Repeat(False, n)


def _resumed_flags(cached: Any, resumed: Any) -> Sequence[bool]:
    """vLLM >= 0.11 has ``resumed_req_ids`` (a set, here non-empty); older ones a per-position list."""
    if resumed is not None:
        return [req_id in resumed for req_id in cached.req_ids]
    return [bool(f) for f in getattr(cached, "resumed_from_preemption", [False] * len(cached.req_ids))]


def translate_scheduler_output(output: Any, step: int) -> SchedulerOutput:
    """kvconn's ``SchedulerOutput`` for one vLLM ``SchedulerOutput``, at a cost that does not grow with the batch.

    Plugins must not change what vLLM sends its workers, and what they do not
    read should cost nothing: vLLM's per-request lists are read-only views
    (:class:`ListView`; ``new_block_ids`` a :class:`NewBlockIdsView`, which
    copies each entry read) and ``num_scheduled_tokens`` a read-only mapping
    over vLLM's dict. ``new_token_ids`` are vLLM's when it sends them
    (pipeline parallelism), else empty lists: vLLM's workers keep sampled
    tokens themselves.
    """
    cached = output.scheduled_cached_reqs
    n = len(cached.req_ids)
    new_token_ids: Sequence[list[int]] = (
        [list(t) for t in cached.new_token_ids] if len(cached.new_token_ids) == n and n else Repeat([], n)
    )
    # The usual step (no new request, none resumed) builds nothing per request.
    resumed = getattr(cached, "resumed_req_ids", None)
    flags = _none_resumed(n) if resumed is not None and not resumed else _resumed_flags(cached, resumed)
    all_token_ids = getattr(cached, "all_token_ids", None)
    return SchedulerOutput(
        step=step,
        scheduled_new_reqs=[
            NewRequestData(r.req_id, list(r.prompt_token_ids or []), to_block_ids(r.block_ids), r.num_computed_tokens)
            for r in output.scheduled_new_reqs
        ]
        if output.scheduled_new_reqs
        else [],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=ListView(cached.req_ids),
            resumed_from_preemption=flags,
            new_token_ids=new_token_ids,
            new_block_ids=NewBlockIdsView(cached.new_block_ids),
            num_computed_tokens=ListView(cached.num_computed_tokens),
            all_token_ids={k: list(v) for k, v in all_token_ids.items()} if all_token_ids else {},
        ),
        num_scheduled_tokens=MappingProxyType(output.num_scheduled_tokens),
        total_num_scheduled_tokens=int(output.total_num_scheduled_tokens),
        finished_req_ids=set(output.finished_req_ids),
    )


def check_kv_caches(kv_caches: Mapping[str, Any], context: ConnectorContext) -> dict[str, Any]:
    """vLLM's per-layer KV caches, checked, for the plugins (same tensors, no copy).

    vLLM hands ``register_kv_caches`` one tensor per attention layer of shape
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, which
    ``ConnectorContext.kv_layout`` reports as ``"vllm-BHNC"``; how K and V
    share the last two axes depends on the attention backend (docs/vllm.md).
    kvconn relies on what every accepted backend has in common: axis 0 is the
    block id, as in the reference layout, and the tensor is contiguous, so each
    block is one contiguous slab that plugins moving whole blocks (offload,
    mooncake) copy as bytes. Other shapes (MLA, state-space layers) and
    layouts whose blocks are not contiguous are refused with a clear error.
    """
    for name, kv in kv_caches.items():
        if kv.dim() != 4 or kv.shape[2] != context.block_size or kv.shape[3] % 2:
            raise ValueError(
                f"kvconn's vLLM adapter supports attention KV caches of shape "
                f"[num_blocks, num_kv_heads, block_size={context.block_size}, 2 * head_size]; layer {name!r} "
                f"has shape {list(kv.shape)} (MLA and state-space layers are not supported): "
                f"remove kv_transfer_config or use a model with standard attention"
            )
        if not kv.is_contiguous():
            raise ValueError(
                f"kvconn's vLLM adapter moves KV blocks as contiguous slabs, but layer {name!r} has shape "
                f"{list(kv.shape)} with strides {list(kv.stride())}: its blocks are not contiguous (this attention "
                f"backend's KV-cache layout is not block-contiguous); use a backend with a layer-major, "
                f"block-contiguous layout (vLLM's LBHNC) or remove kv_transfer_config"
            )
    return dict(kv_caches)
