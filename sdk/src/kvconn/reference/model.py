"""The reference model: deterministic, cheap, and sensitive to wrong KV.

KV written at position ``p`` of layer ``l`` is a function of a rolling hash of
*all* tokens up to ``p``, so identical prefixes give bit-identical KV (which is
what makes prefix caching and KV transfer correct), and the next token is a
function of the KV the model *reads* from the cache through the block table,
so a wrong, missing or stale block changes the generated tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["ReferenceModel", "prefix_hashes"]

_MOD = (1 << 61) - 1


def prefix_hashes(token_ids: Sequence[int], known: list[int]) -> list[int]:
    """Extend ``known`` (rolling hashes of ``token_ids[:len(known)]``) to all of ``token_ids``.

    Hash ``p`` covers tokens ``0..p``; ``known`` is a cache kept per request.
    """
    h = known[-1] if known else 0
    for t in token_ids[len(known) :]:
        h = (h * 1_000_003 + t + 1) % _MOD
        known.append(h)
    return known


class ReferenceModel:
    """KV values and sampling for the reference worker (torch, CPU or CUDA)."""

    def __init__(self, *, num_kv_heads: int, head_dim: int, vocab_size: int, dtype: Any, device: Any) -> None:
        import torch

        self.torch = torch
        self.num_kv_heads, self.head_dim, self.vocab_size = num_kv_heads, head_dim, vocab_size
        self.dtype, self.device = dtype, device
        width = 2 * num_kv_heads * head_dim
        self._freqs = torch.linspace(0.5, 3.0, width, dtype=torch.float32, device=device) / 7919.0

    def kv_inputs(self, hashes: Sequence[int]) -> Any:
        """The per-position input of :meth:`kv_values` (the same for every layer)."""
        torch = self.torch
        return torch.tensor([h % 1_000_003 for h in hashes], dtype=torch.float32, device=self.device)

    def kv_values(self, inputs: Any, layer_index: int) -> Any:
        """KV of layer ``layer_index`` for the positions of ``inputs``: ``[n, 2, num_kv_heads, head_dim]``."""
        values = self.torch.sin(inputs[:, None] * self._freqs[None, :] + (layer_index + 1) * 0.7)
        return values.view(len(inputs), 2, self.num_kv_heads, self.head_dim).to(self.dtype)

    def next_token(self, layer_reads: Sequence[Any]) -> int:
        """Sample from the per-layer reductions of the KV read for the last position.

        Any KV gives a token, NaN and infinities included: a step that read a
        failed load's garbage is discarded by the scheduler, never a crash.
        """
        total = sum(float(r) * (i + 1) for i, r in enumerate(layer_reads))
        if not math.isfinite(total):
            return 0
        return int(abs(total) * 10_007) % self.vocab_size
