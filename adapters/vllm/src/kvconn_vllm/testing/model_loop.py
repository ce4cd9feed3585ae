"""The reference model on vLLM's KV caches: the data drivers' model, whose tokens follow the KV it reads.

:class:`ModelLoop` is a :class:`~.harness.VllmLoop` whose model is the reference model
(:class:`kvconn.reference.model.ReferenceModel`) on real torch KV caches in vLLM's layout: each computed token
writes KV that depends on its whole prefix, and each sampled token is a function of the KV read back through the
live block table (the reference model's digest, every element weighted by its place), so its tokens are the
reference engine's for the same KV shape, and a wrong, stale, missing or rearranged load changes them. Freed blocks
are overwritten between vLLM's calls when asked (``scrub_freed``: a block whose reference count is 0 after
``schedule()`` and after ``update_from_output``), as a busy GPU cache reuses them: vLLM's block pool has no free
callback, and it is not patched.

Read by the data drivers (:mod:`.data_driver`, :mod:`.native_data`); a change to what the model writes or reads
must keep its tokens the reference engine's (``tests/vllm/test_data_checks.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvconn.reference.model import ReferenceModel, adapter_seed, position_weights, prefix_hashes

from .harness import EOS_TOKEN_ID, HEAD_SIZE, NUM_KV_HEADS, VllmLoop

__all__ = ["FREED", "VOCAB_SIZE", "ModelLoop"]

#: What a freed block holds once scrubbed: outside the model's KV range, unlike anything it writes.
FREED = -5.0
#: The reference worker's vocabulary: the sampled tokens are the reference engine's.
VOCAB_SIZE = 32_000


class ModelLoop(VllmLoop):
    """:class:`~.harness.VllmLoop` whose model is the reference model (see the module docstring)."""

    def __init__(
        self, scheduler: Any, *, scrub_freed: bool = False, worker_config: Any = None, worker: Any = None
    ) -> None:
        import torch

        super().__init__(scheduler, worker_config=worker_config, worker=worker)
        if VOCAB_SIZE > EOS_TOKEN_ID:  # sampling vLLM's EOS would end a request the reference engine continues
            raise AssertionError("the model's vocabulary must not reach vLLM's EOS token")
        self.model = ReferenceModel(
            num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE, vocab_size=VOCAB_SIZE, dtype=torch.float16, device="cpu"
        )
        groups = scheduler.kv_cache_config.kv_cache_groups
        self._windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
        self._layer_index = {name: i for i, name in enumerate(self.kv_caches)}  # group order, as the reference's
        self._bits = {name: kv.view(torch.int16) for name, kv in self.kv_caches.items()}
        # the digest's weights in vLLM's layout, [heads, 1, K dims then V dims]: broadcast over a block's slots
        self._weights = {
            name: self.model.read_weights(i).permute(1, 0, 2).reshape(NUM_KV_HEADS, 1, 2 * HEAD_SIZE)
            for name, i in self._layer_index.items()
        }
        self._scrub_freed = scrub_freed
        self._hashes: dict[str, list[int]] = {}
        self._inputs: Any = None  # this step's KV inputs, and per group where they go
        self._targets: list[tuple[Any, Any]] = []
        self._sampling: list[tuple[str, list[list[int]], int]] = []  # (request, its tables, last position)
        self._reads: dict[str, list[int]] = {}

    def _writes(self, output: Any) -> list[list[tuple[int, int, float]]]:
        """Plan the step from the scheduler's live requests and tables, before the step advances them."""
        torch = self.model.torch
        self.scrub()
        for req_id in output.finished_req_ids:
            self._hashes.pop(req_id, None)
        hashes: list[int] = []
        targets: list[tuple[list[int], list[int]]] = [([], []) for _ in self.group_layers]
        self._sampling, self._reads = [], {}
        bs = self.block_size
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tables = [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(req_id)]
            start, end = request.num_computed_tokens - n, request.num_computed_tokens
            known = self._hashes.setdefault(req_id, [])
            adapter = request.lora_request.lora_name if request.lora_request is not None else None
            hashes += prefix_hashes(request.all_token_ids, known, seed=adapter_seed(adapter))[start:end]
            for table, (blocks, offsets) in zip(tables, targets, strict=True):
                blocks += [table[p // bs] for p in range(start, end)]
                offsets += [p % bs for p in range(start, end)]
            if end == request.num_tokens:
                self._sampling.append((req_id, tables, end - 1))
                self._reads[req_id] = []
        self._inputs = self.model.kv_inputs(hashes) if hashes else None
        self._targets = [(torch.tensor(b), torch.tensor(o)) for b, o in targets]
        return []

    def _layer_forward(self, layer_name: str) -> None:
        """One layer: write the step's KV (``[block, head, offset, K|V]``), then read each sampling request's."""
        group, kv = self._group_of[layer_name], self.kv_caches[layer_name]
        index = self._layer_index[layer_name]
        if self._inputs is not None:
            values = self.model.kv_values(self._inputs, index)  # [n, 2, heads, head_dim]
            blocks, offsets = self._targets[group]
            kv[blocks, :, offsets] = values.permute(0, 2, 1, 3).reshape(len(values), NUM_KV_HEADS, 2 * HEAD_SIZE)
        window, bs, torch = self._windows[group], self.block_size, self.model.torch
        for req_id, tables, last in self._sampling:
            first = 0 if window is None else max(0, last - window + 1)
            ids = torch.tensor(tables[group][first // bs : last // bs + 1])
            weighted = self._bits[layer_name][ids] * self._weights[layer_name]
            per_slot = weighted.sum(dim=(1, 3), dtype=torch.int64).view(-1)
            lo = first % bs
            span = slice(lo, lo + last - first + 1)  # the model's digest (kvconn.reference.model): every element counts
            positions = torch.arange(first, last + 1)
            self._reads[req_id].append(int((per_slot[span] * position_weights(positions)).sum()))

    def runner_output(self, output: Any, eos_req_ids: Iterable[str], kv_output: Any) -> Any:
        """The tokens the model sampled, for the requests that finished their prompt or decode this step."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        sampled = [[self.model.next_token(self._reads[r])] if r in self._reads else [] for r in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    def step(self, *, eos_req_ids: Iterable[str] = (), inspect: Any = None) -> tuple[Any, Any]:
        result = super().step(eos_req_ids=eos_req_ids, inspect=inspect)
        self.scrub()  # blocks update_from_output freed (finished requests)
        return result

    def scrub(self) -> None:
        """Overwrite every block vLLM's pool holds free (reference count 0; the null block is left alone)."""
        if not self._scrub_freed:
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        free = [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0]
        if free:
            for kv in self.kv_caches.values():
                kv[free] = FREED
