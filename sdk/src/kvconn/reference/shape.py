"""``EngineShape``: the size and layout of an engine's KV cache and batch, declared once.

The reference engine, ``create_scheduler``, the conformance drivers and the
vLLM harness all build their engine from one :class:`EngineShape`; where one
needs other values than the defaults (a small pool to force preemption, say)
it passes them, and nothing else re-declares the fields.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..context import DEFAULT_KV_CACHE_GROUPS, KVCacheGroupSpec, check_kv_cache_groups

__all__ = ["MAX_NUM_BLOCKS", "EngineShape"]

#: The largest block pool of the reference engine: each block is a Python object and KV in every layer,
#: so a pool far larger only exhausts memory slowly instead of failing at once.
MAX_NUM_BLOCKS = 1 << 22

_POSITIVE = (
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "num_kv_heads",
    "head_dim",
    "tp_size",
)


class EngineShape(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An engine's KV cache and batch limits.

    Attributes:
        block_size: tokens per KV-cache block.
        num_blocks: blocks in the (GPU-side) pool, the null block ``0`` included;
            running requests and the local prefix cache share it.
        max_num_batched_tokens: the token budget of one step (chunked prefill splits longer prompts).
        max_num_seqs: requests running at once.
        max_model_len: the longest request (prompt + generated tokens).
        enable_prefix_caching: whether computed blocks are reused by later requests.
        kv_cache_groups: layers sharing a block table, full attention or sliding window
            (default: one full-attention group of two layers).
        num_kv_heads, head_dim: one layer's KV shape, all ranks together.
        tp_size: tensor-parallel ranks, each holding ``num_kv_heads // tp_size`` heads with a connector
            worker side of its own (the reference engine runs them all; vLLM's test harness runs one).
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 16384
    enable_prefix_caching: bool = True
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = DEFAULT_KV_CACHE_GROUPS
    num_kv_heads: int = 2
    head_dim: int = 8
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ValueError(f"EngineShape {name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(
                f"EngineShape num_blocks must be <= {MAX_NUM_BLOCKS} in the reference engine, got {self.num_blocks}"
            )
        check_kv_cache_groups(self.kv_cache_groups, "EngineShape")
        if self.num_kv_heads % self.tp_size:
            raise ValueError(
                f"EngineShape num_kv_heads ({self.num_kv_heads}) must split evenly over tp_size={self.tp_size} ranks"
            )

    @property
    def heads_per_rank(self) -> int:
        """KV heads on each tensor-parallel rank."""
        return self.num_kv_heads // self.tp_size

    def replace(self, **options: Any) -> EngineShape:
        """This shape with ``options`` (field names) changed, validated like a new one.

        An option that is not a field, or of the wrong type, raises
        ``ValueError`` naming it and listing the fields.
        """
        return EngineShape.from_options(self, **options)

    @classmethod
    def from_options(cls, base: EngineShape | None = None, /, **options: Any) -> EngineShape:
        """``base`` (default: the defaults) with ``options`` changed: how keyword-taking APIs build their shape."""
        unknown = sorted(set(options) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(
                f"unknown engine shape option(s) {unknown}: the fields of EngineShape are "
                f"{', '.join(cls.__struct_fields__)}"
            )
        fields = msgspec.structs.asdict(base) if base is not None else {}
        try:
            return msgspec.convert({**fields, **options}, cls)
        except msgspec.ValidationError as exc:
            message = str(exc)  # a type error, or what __post_init__ raised
            raise ValueError(message if message.startswith("EngineShape") else f"EngineShape: {message}") from None
