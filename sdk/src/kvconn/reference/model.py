"""The reference model: deterministic, cheap, and sensitive to every byte of the KV it reads.

KV written at position ``p`` of layer ``l`` is a function of a rolling hash of
*all* tokens up to ``p`` (and of the adapter the request runs under), so
identical prefixes give bit-identical KV (which is what makes prefix caching
and KV transfer correct), and the next token is a function of the KV the
model *reads* from the cache through the block table, so a wrong, missing or
stale block changes the generated tokens.

What is read counts *in its place*: each layer's read is a keyed digest of
the window's bit patterns, every element weighted by an odd 64-bit weight
that depends on its layer, K or V, head and dimension, times one that
depends on its token position (:meth:`ReferenceModel.read_weights`,
:func:`position_weights`). Integer arithmetic modulo 2**64 is exact in any
order, so the digest does not depend on batching or threads; an odd weight is
invertible modulo 2**64, so changing any one element changes it; and a
rearrangement (K and V exchanged, token slots or heads permuted, two blocks or
two layers exchanged) moves elements under other weights, which changes it
too. A plain sum would not see those: they keep the sum.

Tensor parallelism splits the heads: rank ``r`` of ``tp_size`` holds heads
``[r * n, (r + 1) * n)`` of the full model, its KV and weights are those
heads' slices, and the ranks' digests add up (modulo 2**64, an all-reduce) to
the single-rank model's, so a TP engine generates the same tokens.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DTYPES",
    "VOCAB_SIZE",
    "ReferenceModel",
    "adapter_seed",
    "check_dtype",
    "position_weights",
    "prefix_hashes",
]

_MOD = (1 << 61) - 1
_MASK64 = (1 << 64) - 1

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


def adapter_seed(adapter: str | None) -> int:
    """Where a request's rolling hash starts: 0 for the base model, a value of its own per adapter.

    An adapter (LoRA) changes the KV a prefix computes, as a real adapter's
    weights do, so two adapters' blocks of the same tokens never hold the
    same bytes.
    """
    if adapter is None:
        return 0
    return int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "little") % _MOD


def prefix_hashes(token_ids: Sequence[int], known: list[int], *, seed: int = 0) -> list[int]:
    """Extend ``known`` (rolling hashes of ``token_ids[:len(known)]``) to all of ``token_ids``.

    Hash ``p`` covers tokens ``0..p``; ``known`` is a cache kept per request;
    ``seed`` (:func:`adapter_seed`) is the hash before the first token.
    """
    h = known[-1] if known else seed
    for t in token_ids[len(known) :]:
        h = (h * 1_000_003 + t + 1) % _MOD
        known.append(h)
    return known


class ReferenceModel:
    """KV values, read digests and sampling for the reference worker (torch, CPU or CUDA).

    ``num_kv_heads`` are this rank's heads (rank ``tp_rank`` of ``tp_size``).
    """

    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_dim: int,
        vocab_size: int,
        dtype: Any,
        device: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        import torch

        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.torch = torch
        self.num_kv_heads, self.head_dim, self.vocab_size = num_kv_heads, head_dim, vocab_size
        self.dtype, self.device = dtype, device
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
        self.tp_size = tp_size
        #: this rank's heads among the full model's ``num_kv_heads * tp_size``
        self.heads = slice(tp_rank * num_kv_heads, (tp_rank + 1) * num_kv_heads)
        full = (2, num_kv_heads * tp_size, head_dim)
        freqs = torch.linspace(0.5, 3.0, math.prod(full), dtype=torch.float32, device=device) / 7919.0
        self._freqs = freqs.view(full)[:, self.heads].reshape(-1)
        self._weights: dict[int, Any] = {}

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

    def read_weights(self, layer_index: int) -> Any:
        """The digest's weights of layer ``layer_index``: ``[2, num_kv_heads, head_dim]`` odd int64, this rank's heads.

        Drawn from the element's place in the full model (layer, K or V, head,
        dimension), so a rank's weights are the single-rank model's for its heads.
        """
        weights = self._weights.get(layer_index)
        if weights is None:
            torch = self.torch
            heads = self.num_kv_heads * self.tp_size
            places = torch.arange(2 * heads * self.head_dim, dtype=torch.int64, device=self.device)
            weights = _mix(places + ((layer_index + 1) << 40)).view(2, heads, self.head_dim)[:, self.heads]
            self._weights[layer_index] = weights = weights.contiguous()
        return weights

    def next_token(self, layer_reads: Sequence[int]) -> int:
        """Sample from the per-layer digests of the KV read for the last position (summed over the ranks).

        Every digest counts, in its layer's place. Any KV gives a token, NaN and
        infinities included (digests read bit patterns): a step that read a
        failed load's garbage is discarded by the scheduler, never a crash.
        """
        h = 0x243F6A8885A308D3
        for read in layer_reads:
            h = ((h ^ (int(read) & _MASK64)) * 0x100000001B3) & _MASK64
            h ^= h >> 29
        return h % self.vocab_size


def _mix(values: Any) -> Any:
    """An odd 64-bit mix of each int64 of ``values`` (splitmix's finaliser, wrapping as int64 arithmetic does)."""
    values = values * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    values = values ^ (values >> 30)
    values = values * -4658895280553007687  # 0xBF58476D1CE4E5B9
    values = values ^ (values >> 27)
    values = values * -7723592293110705685  # 0x94D049BB133111EB
    return (values ^ (values >> 31)) | 1


def position_weights(positions: Any) -> Any:
    """The digest's weight of each token position in ``positions`` (an int64 tensor): odd, one per position."""
    return _mix(positions + (1 << 52))
