"""The reference model: deterministic, cheap, and sensitive to wrong KV.

KV written at position ``p`` of layer ``l`` is a function of a rolling hash of
*all* tokens up to ``p``, so identical prefixes give bit-identical KV (which is
what makes prefix caching and KV transfer correct), and the next token is a
function of the KV the model *reads* from the cache through the block table,
so a wrong, missing or stale block changes the generated tokens.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

__all__ = ["DTYPES", "VOCAB_SIZE", "ReferenceModel", "check_dtype", "prefix_hashes"]

_MOD = (1 << 61) - 1

#: The KV dtypes the reference model computes in: floating point, so its KV values (sines) survive the cast.
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Token ids are ``0 <= id < VOCAB_SIZE``, what the model samples from (unless a worker is given another size).
VOCAB_SIZE = 32_000


def check_dtype(dtype: str) -> None:
    """Refuse a KV dtype the reference model cannot compute in: ``ValueError`` naming ``dtype`` and :data:`DTYPES`.

    An integer dtype would hold its KV values (all in ``(-1, 1)``) as zeros, and
    the output would be garbage no connector could be blamed for.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} for the reference engine, got {dtype!r}")


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

        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.torch = torch
        self.num_kv_heads, self.head_dim, self.vocab_size = num_kv_heads, head_dim, vocab_size
        self.dtype, self.device = dtype, device
        width = 2 * num_kv_heads * head_dim
        self._freqs = torch.linspace(0.5, 3.0, width, dtype=torch.float32, device=device) / 7919.0

    def check_token_ids(self, token_ids: Sequence[int], what: str) -> None:
        """Refuse token ids outside the vocabulary, ``0 <= id < vocab_size``: ``ValueError`` naming ``what``.

        A real engine refuses them too; here a negative id or one past 2**63
        would reach the block hashes and the model as numbers they were never meant for.
        """
        for position, token in enumerate(token_ids):
            try:
                valid = 0 <= operator.index(token) < self.vocab_size
            except TypeError:  # not an integer (a float, a string)
                valid = False
            if not valid:
                raise ValueError(
                    f"{what} must be integers in [0, {self.vocab_size}) (the reference model's vocabulary), "
                    f"got {token!r} at position {position}"
                )

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
