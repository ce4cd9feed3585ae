"""The reference model on vLLM's KV caches: the data drivers' model, whose tokens follow the KV it reads.

:class:`ModelLoop` is a :class:`~.harness.VllmLoop` whose model is the reference model
(:class:`kvconn.reference.model.ReferenceModel`) on real torch KV caches in vLLM's layout: each computed token
writes KV that depends on its whole prefix, and each sampled token is a function of the KV read back through the
live block table (the reference model's digest, every element weighted by its place), so its tokens are the
reference engine's for the same KV shape, and a wrong, stale, missing or rearranged load changes them. With
``tp_size`` 2 (KV048) every rank runs its shard of the model beside its own worker-side connector. Each load that
lands is compared with the KV the model computes (:meth:`ModelLoop.audit`, with
:func:`~kvconn.testing.conformance.loaded_kv.audit_load`, on every rank), so a wrong token is traced as on the
reference engine. Freed blocks
are overwritten between vLLM's calls when asked (``scrub_freed``: a block whose reference count is 0 after
``schedule()`` and after ``update_from_output``), as a busy GPU cache reuses them: vLLM's block pool has no free
callback, and it is not patched. A block that ``schedule()`` itself freed (a preemption) keeps its bytes until the
step ends: vLLM's worker lets the connector finish with it (``handle_preemptions``) before the step's forward.

Read by the data drivers (:mod:`.data_driver`, :mod:`.native_data`); a change to what the model writes or reads
must keep its tokens the reference engine's (``tests/vllm/test_data_checks.py`` compares them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from kvconn.reference.model import ReferenceModel, adapter_seed, position_weights, prefix_hashes
from kvconn.testing.conformance.loaded_kv import LoadedBlock, audit_load

from .harness import EOS_TOKEN_ID, HEAD_SIZE, NUM_KV_HEADS, VllmLoop

__all__ = ["FREED", "VOCAB_SIZE", "ModelLoop"]

#: What a freed block holds once scrubbed: outside the model's KV range, unlike anything it writes.
FREED = -5.0
#: The reference worker's vocabulary: the sampled tokens are the reference engine's.
VOCAB_SIZE = 32_000


class _Landing(NamedTuple):
    """A load that lands this step: its request, tokens and adapter's seed, its tables, the positions loaded."""

    req_id: str
    token_ids: list[int]
    seed: int
    table: list[list[int]]
    blocks: range


class ModelLoop(VllmLoop):
    """:class:`~.harness.VllmLoop` whose model is the reference model (see the module docstring).

    Each rank runs the reference model's shard of its heads (``tp_rank``, ``tp_size``): it writes
    its heads' KV and digests what it reads, and the ranks' digests of each layer add up (an
    all-reduce) to the single-rank model's before sampling, as in the reference engine
    (:class:`kvconn.reference.ranks.TensorParallelWorkers`).
    """

    def __init__(
        self,
        scheduler: Any,
        *,
        scrub_freed: bool = False,
        worker_config: Any = None,
        make_worker: Callable[[Any], Any] | None = None,
    ) -> None:
        import torch

        super().__init__(scheduler, worker_config=worker_config, make_worker=make_worker)
        if VOCAB_SIZE > EOS_TOKEN_ID:  # sampling vLLM's EOS would end a request the reference engine continues
            raise AssertionError("the model's vocabulary must not reach vLLM's EOS token")
        heads = NUM_KV_HEADS // self.tp_size
        #: per rank, the reference model's shard of the heads
        self.models = [
            ReferenceModel(
                num_kv_heads=heads,
                head_dim=HEAD_SIZE,
                vocab_size=VOCAB_SIZE,
                dtype=torch.float16,
                device="cpu",
                tp_rank=rank.index,
                tp_size=self.tp_size,
            )
            for rank in self.ranks
        ]
        self.model = self.models[0]
        groups = scheduler.kv_cache_config.kv_cache_groups
        self._windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
        self._layer_index = {name: i for i, name in enumerate(self.kv_caches)}  # group order, as the reference's
        self._bits = [{name: kv.view(torch.int16) for name, kv in rank.kv_caches.items()} for rank in self.ranks]
        # the digest's weights in vLLM's layout, [heads, 1, K dims then V dims]: broadcast over a block's slots
        self._weights = [
            {
                name: model.read_weights(i).permute(1, 0, 2).reshape(heads, 1, 2 * HEAD_SIZE)
                for name, i in self._layer_index.items()
            }
            for model in self.models
        ]
        self._scrub_freed = scrub_freed
        self._held: set[int] = set()  # the blocks held when the last step ended
        self._hashes: dict[str, list[int]] = {}
        self._inputs: Any = None  # this step's KV inputs, and per group where they go
        self._targets: list[tuple[Any, Any]] = []
        self._sampling: list[tuple[str, list[list[int]], int]] = []  # (request, its tables, last position)
        self._reads: list[dict[str, list[int]]] = []  # per rank, per sampling request, each layer's digest
        # the caches in the reference engine's layout, [blocks, K|V, block_size, heads, head_dim], to audit loads
        self._audited = [
            {name: kv.unflatten(-1, (2, HEAD_SIZE)).permute(0, 3, 2, 1, 4) for name, kv in rank.kv_caches.items()}
            for rank in self.ranks
        ]
        self._expected: dict[str, range] = {}  # request -> table positions of its committed load, not landed yet
        self._landing: list[_Landing] = []  # the loads that land this step

    def _writes(self, output: Any) -> list[list[tuple[int, int, float]]]:
        """Plan the step from the scheduler's live requests and tables, before the step advances them."""
        torch = self.model.torch
        self.scrub(keep=self._held)  # not what this schedule() freed by preemption: see the module docstring
        for req_id in output.finished_req_ids:
            self._hashes.pop(req_id, None)
        hashes: list[int] = []
        targets: list[tuple[list[int], list[int]]] = [([], []) for _ in self.group_layers]
        self._sampling, self._landing = [], []
        bs = self.block_size
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tables = [list(t) for t in self.scheduler.kv_cache_manager.get_block_ids(req_id)]
            start, end = request.num_computed_tokens - n, request.num_computed_tokens
            known = self._hashes.setdefault(req_id, [])
            adapter = request.lora_request.lora_name if request.lora_request is not None else None
            seed = adapter_seed(adapter)
            hashes += prefix_hashes(request.all_token_ids, known, seed=seed)[start:end]
            loaded = self._expected.pop(req_id, None)
            if loaded is not None and loaded.start < start // bs:  # blocks vLLM kept (a failed one is recomputed)
                landed = range(loaded.start, min(loaded.stop, start // bs))
                self._landing.append(_Landing(req_id, list(request.all_token_ids), seed, tables, landed))
            for table, (blocks, offsets) in zip(tables, targets, strict=True):
                blocks += [table[p // bs] for p in range(start, end)]
                offsets += [p % bs for p in range(start, end)]
            if end == request.num_tokens:
                self._sampling.append((req_id, tables, end - 1))
        self._reads = [{req_id: [] for req_id, _, _ in self._sampling} for _ in self.ranks]
        self._inputs = self.model.kv_inputs(hashes) if hashes else None
        self._targets = [(torch.tensor(b), torch.tensor(o)) for b, o in targets]
        return []

    def _layer_forward(self, layer_name: str) -> None:
        """One layer of the running rank: write the step's KV (``[block, head, offset, K|V]``), then read each
        sampling request's."""
        rank = self._rank.index
        model, kv = self.models[rank], self._rank.kv_caches[layer_name]
        group, index = self._group_of[layer_name], self._layer_index[layer_name]
        if self._inputs is not None:
            values = model.kv_values(self._inputs, index)  # [n, 2, heads, head_dim]
            blocks, offsets = self._targets[group]
            kv[blocks, :, offsets] = values.permute(0, 2, 1, 3).reshape(len(values), model.num_kv_heads, -1)
        window, bs, torch = self._windows[group], self.block_size, model.torch
        for req_id, tables, last in self._sampling:
            first = 0 if window is None else max(0, last - window + 1)
            ids = torch.tensor(tables[group][first // bs : last // bs + 1])
            weighted = self._bits[rank][layer_name][ids] * self._weights[rank][layer_name]
            per_slot = weighted.sum(dim=(1, 3), dtype=torch.int64).view(-1)
            lo = first % bs
            span = slice(lo, lo + last - first + 1)  # the model's digest (kvconn.reference.model): every element counts
            positions = torch.arange(first, last + 1)
            self._reads[rank][req_id].append(int((per_slot[span] * position_weights(positions)).sum()))

    def runner_output(self, output: Any, eos_req_ids: Iterable[str], kv_output: Any) -> Any:
        """The tokens the model sampled, for the requests that finished their prompt or decode this step.

        Each layer's digest is the sum of the ranks' (the all-reduce), as the reference engine's.
        """
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(output.num_scheduled_tokens)
        sampled = [[self._sample(r)] if r in self._reads[0] else [] for r in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

    def expect_load(self, req_id: str, blocks: range) -> None:
        """Audit the table positions ``blocks`` of ``req_id`` (a load the connector committed) once it lands: on
        the next step that computes the request (a sync load lands in it, an async one before it)."""
        self._expected[req_id] = blocks

    def audit(self, step: int, skip: set[int]) -> list[LoadedBlock]:
        """The layer-blocks of this step's landed loads that hold other KV than the model computes, on every rank
        (:func:`~kvconn.testing.conformance.loaded_kv.audit_load`); blocks in ``skip`` (reported failed) are not
        audited."""
        layers = [(name, self._group_of[name]) for name in self._layer_index]
        found = []
        for load in self._landing:
            for model, kv_caches in zip(self.models, self._audited, strict=True):
                found += audit_load(
                    model,
                    kv_caches,
                    layers,
                    req_id=load.req_id,
                    step=step,
                    token_ids=load.token_ids,
                    table=load.table,
                    blocks=load.blocks,
                    skip=skip,
                    seed=load.seed,
                    ranks=self.models,
                )
        return found

    def _sample(self, req_id: str) -> int:
        per_layer = zip(*(reads[req_id] for reads in self._reads), strict=True)  # each layer: every rank's digest
        return self.model.next_token([sum(digests) for digests in per_layer])

    def step(self, *, eos_req_ids: Iterable[str] = (), inspect: Any = None) -> tuple[Any, Any]:
        result = super().step(eos_req_ids=eos_req_ids, inspect=inspect)
        self.scrub()  # blocks update_from_output freed (finished requests), and those preempted this step
        if self._scrub_freed:  # what the next schedule() may free by preemption, kept until that step ends
            self._held = {b.block_id for b in self.scheduler.kv_cache_manager.block_pool.blocks[1:] if b.ref_cnt}
        return result

    def scrub(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Overwrite every block vLLM's pool holds free (reference count 0; the null block is left alone) but
        ``keep``."""
        if not self._scrub_freed:
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        free = [b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_id not in keep]
        if free:
            for kv in (kv for rank in self.ranks for kv in rank.kv_caches.values()):
                kv[free] = FREED
