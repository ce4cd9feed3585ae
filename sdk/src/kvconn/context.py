"""Static facts about the engine a connector instance serves."""

from __future__ import annotations

import msgspec

__all__ = [
    "DEFAULT_KV_CACHE_GROUPS",
    "NULL_BLOCK_ID",
    "ConnectorContext",
    "KVCacheGroupSpec",
    "check_kv_cache_groups",
]


class KVCacheGroupSpec(msgspec.Struct, frozen=True):
    """One KV-cache group: layers that share a block table.

    ``sliding_window`` is ``None`` for full attention; for sliding-window
    attention it is the window in tokens, and table entries for blocks wholly
    outside the window are the null block (id ``0``), which holds no data and
    must never be saved or loaded.
    """

    layer_names: tuple[str, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError("KVCacheGroupSpec layer_names must name at least one layer, got none")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"KVCacheGroupSpec sliding_window must be >= 1 token (or None for full attention), "
                f"got {self.sliding_window}"
            )

    def first_needed_block(self, num_computed_tokens: int, block_size: int) -> int:
        """Index of the first block the next token can read once ``num_computed_tokens`` are computed.

        ``0`` for full attention. In a sliding-window group the entries before it
        are the null block: engine and connectors must agree on this boundary,
        or a connector saves or loads blocks the engine has freed.
        """
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // block_size)


NULL_BLOCK_ID = 0


def check_kv_cache_groups(groups: tuple[KVCacheGroupSpec, ...], owner: str) -> None:
    """Refuse a layout no engine has: no group, or a layer in two places (its group would be ambiguous).

    Raises ``ValueError`` naming ``owner``'s ``kv_cache_groups`` field and the layer.
    """
    if not groups:
        raise ValueError(f"{owner} kv_cache_groups must hold at least one group, got none")
    where: dict[str, int] = {}
    for g, spec in enumerate(groups):
        for layer in spec.layer_names:
            if layer in where:
                raise ValueError(
                    f"{owner} kv_cache_groups: layer {layer!r} is named twice (groups {where[layer]} and {g}); "
                    "every layer belongs to exactly one group, once"
                )
            where[layer] = g


#: The reference engine's default layout: one full-attention group of two layers.
DEFAULT_KV_CACHE_GROUPS = (KVCacheGroupSpec(("layer.0", "layer.1")),)


class ConnectorContext(msgspec.Struct, frozen=True, kw_only=True):
    """What a connector knows about its engine when it is created.

    Everything that changes what a block's bytes mean (model, dtype, layout,
    block size, KV shape, tensor-parallel rank, group) is here, so connectors
    that share blocks across engines can namespace their keys with it.
    ``num_kv_heads`` and ``head_dim`` are one layer's KV shape on this worker
    (after tensor-parallel splitting); ``None`` where the engine does not say.
    """

    model: str = "kvconn-reference"
    dtype: str = "float16"
    block_size: int = 16
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = DEFAULT_KV_CACHE_GROUPS
    kv_layout: str = "NHD"
    tp_rank: int = 0
    tp_size: int = 1
    engine_id: str = "kvconn-engine"
    num_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "tp_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ConnectorContext {name} must be >= 1, got {value}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"ConnectorContext tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}")
        check_kv_cache_groups(self.kv_cache_groups, "ConnectorContext")

    def group_of_layer(self) -> dict[str, int]:
        """Map each layer name to the index of its KV-cache group."""
        return {layer: g for g, spec in enumerate(self.kv_cache_groups) for layer in spec.layer_names}
