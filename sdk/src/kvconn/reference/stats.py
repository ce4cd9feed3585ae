"""Counters of an engine run."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """What a run cost and what the connectors bought.

    ``prompt_tokens_computed`` counts prompt positions the model computed and
    ``prompt_tokens_loaded`` those a connector loaded (after a preemption
    either counts again);
    ``prompt_tokens_cached`` came from the local prefix cache and
    ``prompt_tokens_loaded`` from a connector. Block and byte counters are
    summed from the connectors' ``get_kv_connector_stats``.
    """

    steps: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_loaded: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    blocks_saved: int = 0
    blocks_loaded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    failed_load_blocks: int = 0
    degraded_events: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
