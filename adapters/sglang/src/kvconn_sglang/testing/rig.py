"""SGLang's own pools, factory and HiCacheController on the CPU, driven as SGLang's scheduler drives them.

Nothing of SGLang is stubbed: the device pools are ``MHATokenToKVPool`` /
``MLATokenToKVPool`` on ``device="cpu"``, the host pools SGLang's own (every
layout, ``pin_memory=False``), the backend comes from
``StorageBackendFactory``'s dynamic path, and :class:`Controller` runs a real
``HiCacheController`` (one-rank gloo group) whose backup and prefetch threads
call the backend. What SGLang's radix tree would do between the controller's
queues (allocate host slots for a storage hit, hand it to the I/O thread) is
done here with the controller's and pool's own calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import extra_config

__all__ = [
    "MHA_LAYOUTS",
    "MLA_LAYOUTS",
    "PAGE",
    "Controller",
    "Prefetched",
    "extra",
    "fill_known",
    "init_sglang",
    "make_pools",
    "page",
    "same_pages",
    "storage_config",
    "swap_store_class",
]

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4
TOKENS = 128


def init_sglang() -> None:
    """A one-rank gloo world and SGLang's parallel context (what its launcher publishes), once per process."""
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():  # a port of its own (not MASTER_PORT, which a child process would inherit)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def make_pools(kind: str, layout: str, *, dtype: torch.dtype = torch.float16, layers: int = 3) -> tuple[Any, Any]:
    """(device pool, host pool) of SGLang's, on the CPU; ``kind`` is ``"mha"`` or ``"mla"``."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    common = {"device": "cpu", "enable_memory_saver": False, "start_layer": 0, "end_layer": layers - 1}
    if kind == "mha":
        device = MHATokenToKVPool(TOKENS, PAGE, dtype, head_num=2, head_dim=8, layer_num=layers, **common)
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 4.0, 0, PAGE, layout, pin_memory=False,
            device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
        )  # fmt: skip
    else:
        device = MLATokenToKVPool(TOKENS, PAGE, dtype, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=layers, **common)
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 4.0, 0, PAGE, layout, pin_memory=False,
            device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
            target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim,
        )  # fmt: skip
    return device, host


def storage_config(
    extra: dict[str, Any], *, mla: bool = False, model: str = "kvconn/test-model", tp: tuple[int, int] = (0, 1)
) -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its controller builds it for one rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=model, extra_config=dict(extra),
    )  # fmt: skip


def fill_known(host: Any, seed: int) -> None:
    """Known bytes in every host slot: a seeded pattern, so any misplaced byte shows."""
    g = torch.Generator().manual_seed(seed)
    buffer = host.kv_buffer
    buffer.copy_(torch.randn(buffer.shape, generator=g).to(buffer.dtype))


def page(host: Any, host_indices: Any, i: int) -> torch.Tensor:
    """Page ``i`` of ``host_indices``, as SGLang reads it (a copy)."""
    return host.get_data_page(int(host_indices[i * host.page_size])).clone()


def same_pages(host: Any, saved: Any, loaded: Any, n: int) -> int | None:
    """The first of ``n`` pages whose bytes differ between ``saved`` and ``loaded``; ``None`` when all match."""
    return next((i for i in range(n) if not torch.equal(page(host, saved, i), page(host, loaded, i))), None)


@dataclass
class Prefetched:
    """What a prefetch got: the hit SGLang's query agreed on, the tokens it loaded, and where."""

    hit_tokens: int
    loaded_tokens: int
    host_indices: Any


class Controller:
    """A real ``HiCacheController`` over ``host`` with the kvconn backend ``extra`` configures."""

    @classmethod
    def over(cls, extra: dict[str, Any], kind: str = "mha", layout: str = "page_first", **kw: Any) -> Controller:
        """A controller over fresh pools of ``kind`` and ``layout`` (``kw``: ``model``, or ``seed`` for known
        bytes in the host pool)."""
        seed = kw.pop("seed", None)
        device, host = make_pools(kind, layout)
        ctl = cls(device, host, extra, **kw)
        if seed is not None:
            fill_known(host, seed)
        return ctl

    def __init__(self, device: Any, host: Any, extra: dict[str, Any], *, model: str = "kvconn/test-model") -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        init_sglang()
        allocator = PagedTokenToKVPoolAllocator(TOKENS, PAGE, device.dtype, "cpu", device, need_sort=False)
        self.host = host
        self.cc = HiCacheController(
            allocator, host, PAGE, dist.group.WORLD, threading.Event(), storage_backend="dynamic",
            model_name=model, storage_backend_extra_config=dict(extra), prefetch_threshold=PAGE,
        )  # fmt: skip
        self.backend: Any = self.cc.storage_backend

    def swap_store_class(self, store_class: Any) -> None:
        """Run the tier over ``store_class`` (a fault-injecting subclass) from now on, same spec and pool."""
        swap_store_class(self.backend, self.host, store_class)

    def hashes(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        result: list[str] = get_storage_hash_str(tokens, None, page_size=PAGE)
        return result

    def backup(self, tokens: list[int], host_indices: Any, *, timeout: float = 30.0) -> int:
        """``write_storage`` then the backup thread's ack: the tokens it stored."""
        self.cc.write_storage(host_indices, tokens, hash_value=self.hashes(tokens))
        done = self.cc.ack_backup_queue.get(timeout=timeout)
        completed: int = done.completed_tokens
        return completed

    def prefetch(self, tokens: list[int], *, timeout: float = 30.0) -> Prefetched:
        """``prefetch``; then, as the radix tree does, host slots for the hit and the I/O thread; its last ack."""
        self.cc.prefetch("req", tokens)
        operation = self.cc.prefetch_hit_queue.get(timeout=timeout)
        hit = operation.storage_hit_count
        if hit == 0:
            return Prefetched(0, 0, None)
        operation.host_indices = self.host.alloc(hit)
        self.cc.prefetch_buffer.put(operation)
        loaded = 0
        while True:
            ack = self.cc.ack_prefetch_queue.get(timeout=timeout)
            if ack.completed_req:
                return Prefetched(hit, loaded, operation.host_indices)
            loaded = ack.completed_tokens

    def close(self) -> None:
        self.cc.detach_storage_backend()


def swap_store_class(backend: Any, host: Any, store_class: Any) -> None:
    """Run ``backend``'s tier over ``store_class`` (a subclass of its connector) from now on, same spec and pool."""
    from ..tier import PageTier

    old = backend.tier
    tier = PageTier(old.spec, old.storage_config, store_class)
    tier.register(host)
    backend.tier = tier
    old.close()


def extra(store: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The extra config SGLang is given for ``store`` (see :func:`kvconn_sglang.extra_config`)."""
    return extra_config(store, config)
