"""What makes an SGLang page's bytes mean something, as the kvconn context its keys are namespaced by.

SGLang's page keys are bare SHA-256 chains over token ids: the same prompt gives
the same key in every deployment, whatever the model, dtype, page size, head
shard or host layout. kvconn's keys put the engine's context in front of the
hash (:func:`kvconn.hashing.context_namespace`, through the store connector's
own :class:`~kvconn.store.BlockKeys`), so this module only says what SGLang's
context is: two deployments that differ in any of it never read each other's
pages, and never a vLLM engine's blocks (the layout names the engine).
"""

from __future__ import annotations

from typing import Any

from kvconn import ConnectorContext, KVCacheGroupSpec

__all__ = ["is_mla", "namespace_suffix", "sglang_context"]


def is_mla(storage_config: Any, pool: Any) -> bool:
    """MLA (or another rank-replicated cache): every TP rank holds the same bytes, so they share keys."""
    return bool(getattr(storage_config, "is_mla_model", False)) or hasattr(pool, "kv_cache_dim")


def sglang_context(storage_config: Any, pool: Any) -> ConnectorContext:
    """The context of the pages ``pool`` (an SGLang host pool) holds for the rank ``storage_config`` describes."""
    mla = is_mla(storage_config, pool)
    first = int(getattr(pool, "start_layer", 0) or 0)
    layers = tuple(f"layer.{i}" for i in range(first, first + int(pool.layer_num)))
    return ConnectorContext(
        model=storage_config.model_name or "unnamed-model",
        dtype=str(pool.dtype).removeprefix("torch."),
        block_size=int(pool.page_size),
        kv_cache_groups=(KVCacheGroupSpec(layers),),
        kv_layout=f"sglang/{'mla' if mla else 'mha'}/{pool.layout}",
        # MLA pages are replicated across TP ranks: one key for all of them (SGLang has one writer).
        tp_rank=0 if mla else int(storage_config.tp_rank),
        tp_size=1 if mla else int(storage_config.tp_size),
        engine_id="sglang",
        num_kv_heads=1 if mla else int(pool.head_num),
        head_dim=int(pool.kv_cache_dim if mla else pool.head_dim),
    )


def namespace_suffix(storage_config: Any, pool: Any) -> str:
    """The rest of the shard identity, beyond the context: pipeline stage, context-parallel shards, V width."""
    parts = [
        f"pp={storage_config.pp_rank}/{storage_config.pp_size}",
        f"cp={storage_config.attn_cp_rank}/{storage_config.attn_cp_size}",
        f"dcp={getattr(storage_config, 'dcp_rank', 0)}/{getattr(storage_config, 'dcp_size', 1)}",
    ]
    if not is_mla(storage_config, pool):
        parts.append(f"v_head_dim={getattr(pool, 'v_head_dim', pool.head_dim)}")
    return ",".join(parts)
