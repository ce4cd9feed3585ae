"""The reference worker: real torch KV caches, driven by ``SchedulerOutput``.

Per step, exactly as a model runner does with a connector: bind metadata,
``start_load_kv``; then per layer ``wait_for_layer_load``, write this step's
KV through the block table, read the context for sampling, ``save_kv_layer``;
then ``wait_for_save`` and ``get_finished``.

The cost is a few batched torch ops per layer whatever the number of
requests (the indices are built once a step per KV-cache group): a write
scatters every computed position of every request, a read gathers every
sampling request's context blocks and sums their weighted bit patterns per token,
then per request with one ``index_add_``: the model's keyed digest, every
element weighted by its place (:mod:`.model`). Integer sums are exact in any
order, so what a request reads does not depend on which other requests
share its step nor on torch's thread count, and any changed or moved element
of the KV it reads changes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..context import ConnectorContext
from ..host import WorkerHost
from ..outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from .model import VOCAB_SIZE, ReferenceModel, adapter_seed, check_dtype, position_weights, prefix_hashes

__all__ = ["Forward", "ReferenceWorker"]


@dataclass(frozen=True)
class Forward:
    """One rank's step before sampling: per sampling request its per-layer digests; the connectors' report."""

    reads: dict[str, list[int]]
    connector_output: dict[str, KVConnectorOutput]


@dataclass
class _RequestState:
    token_ids: list[int]
    tables: list[list[int]]
    seed: int  # where its rolling hash starts: its adapter's (model.adapter_seed)
    hashes: list[int] = field(default_factory=list)


class ReferenceWorker:
    """Holds ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` KV caches per layer.

    ``torch_threads`` sets torch's intra-op thread count (process-wide) when
    the worker is created: its ops are small, and on a busy machine torch's
    default threads wait on each other (steps/s fell from ~1,000 to ~20 on
    2 shared cores). ``None`` leaves the count alone.
    """

    def __init__(
        self,
        context: ConnectorContext,
        *,
        num_blocks: int,
        host: WorkerHost | None = None,
        num_kv_heads: int = 2,
        head_dim: int = 8,
        vocab_size: int = VOCAB_SIZE,
        device: str = "cpu",
        torch_threads: int | None = 1,
    ) -> None:
        import torch

        if torch_threads is not None and torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        self.context = context
        self.host = host
        self.block_size = context.block_size
        check_dtype(context.dtype)
        dtype = getattr(torch, context.dtype)
        self.model = ReferenceModel(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab_size,
            dtype=dtype,
            device=device,
            tp_rank=context.tp_rank,
            tp_size=context.tp_size,
        )
        self.layers = [
            (name, g, spec.sliding_window)
            for g, spec in enumerate(context.kv_cache_groups)
            for name in spec.layer_names
        ]
        self.kv_caches: dict[str, Any] = {
            name: torch.zeros((num_blocks, 2, self.block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            for name, _, _ in self.layers
        }
        # The same memory as integers of the element's width: reads digest bit patterns, weighted by place.
        width = self.kv_caches[self.layers[0][0]].element_size()
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        self._bits = {name: kv.view(bits) for name, kv in self.kv_caches.items()}
        # [2, 1, heads, dim]: broadcast over a block's token slots, the cache's layout
        self._weights = [self.model.read_weights(index)[:, None] for index in range(len(self.layers))]
        self._requests: dict[str, _RequestState] = {}
        if host is not None:
            host.register_kv_caches(self.kv_caches)

    def _update_states(self, output: SchedulerOutput) -> None:
        for req_id in output.finished_req_ids:
            self._requests.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            tables = [list(t) for t in new.block_ids]
            self._requests[new.req_id] = _RequestState(list(new.prompt_token_ids), tables, adapter_seed(new.adapter))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                tables = [list(t) for t in new_blocks] if new_blocks else []
                seed = self._requests[req_id].seed  # kept across preemption, as its adapter is
                self._requests[req_id] = _RequestState(list(cached.all_token_ids[req_id]), tables, seed)
                continue
            state = self._requests[req_id]
            state.token_ids.extend(cached.new_token_ids[i])
            if new_blocks:
                for table, added in zip(state.tables, new_blocks, strict=True):
                    table.extend(added)

    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample: every request that reached its last token gets one."""
        step = self.forward(output)
        sampled = {req_id: [self.model.next_token(r)] for req_id, r in step.reads.items()}
        return ModelRunnerOutput(
            req_ids=list(output.num_scheduled_tokens),
            sampled_token_ids=sampled,
            kv_connector_output=step.connector_output,
        )

    def forward(self, output: SchedulerOutput) -> Forward:
        """Run one step up to sampling: the connector's hooks, KV written, and what each sampling request read.

        A tensor-parallel engine adds the ranks' reads before sampling (:mod:`.ranks`).
        """
        self._update_states(output)
        host, torch = self.host, self.model.torch
        if host is not None:
            host.bind_connector_metadata(output.kv_connector_metadata)
            host.start_load_kv()

        # Positions computed this step, per request, and where their KV goes.
        positions: list[tuple[str, int, int]] = []
        hashes: list[int] = []
        starts = output.num_computed_tokens_by_request()
        for req_id, n in output.num_scheduled_tokens.items():
            state, start = self._requests[req_id], starts[req_id]
            hashes.extend(prefix_hashes(state.token_ids, state.hashes, seed=state.seed)[start : start + n])
            positions.append((req_id, start, n))
        sampling = [
            (req_id, start + n - 1)
            for req_id, start, n in positions
            if start + n == len(self._requests[req_id].token_ids)
        ]
        # Where this step's KV goes and what sampling reads depend on the group, not the layer.
        windows = {group: window for _, group, window in self.layers}
        inputs = self.model.kv_inputs(hashes) if hashes else None
        writes = {group: self._write_index(positions, group) for group in windows} if hashes else {}
        spans = {group: self._read_index(sampling, group, window) for group, window in windows.items()}
        reads: list[Any] = []  # per layer: [len(sampling)] int64 sums of the context each request reads

        for layer_index, (name, group, _) in enumerate(self.layers):
            if host is not None:
                host.wait_for_layer_load(name)
            kv = self.kv_caches[name]
            if inputs is not None:
                blocks, offsets = writes[group]
                kv[blocks, :, offsets] = self.model.kv_values(inputs, layer_index)
            if sampling:
                ids, segment, slot_weights = spans[group]
                per_slot = (self._bits[name][ids] * self._weights[layer_index]).sum(dim=(1, 3, 4), dtype=torch.int64)
                per_slot = per_slot.view(-1) * slot_weights
                sums = per_slot.new_zeros(len(sampling) + 1).index_add_(0, segment, per_slot)
                reads.append(sums[:-1])
            if host is not None:
                host.save_kv_layer(name, kv)

        connector_output = {}
        if host is not None:
            host.wait_for_save()
            connector_output = host.get_finished(set(output.finished_req_ids))
        per_request = torch.stack(reads, dim=1).tolist() if sampling else []
        return Forward({req_id: r for (req_id, _), r in zip(sampling, per_request, strict=True)}, connector_output)

    def _write_index(self, positions: list[tuple[str, int, int]], group: int) -> tuple[Any, Any]:
        """Block and in-block offset of every position computed this step, in ``group``'s tables."""
        bs, blocks, offsets = self.block_size, [], []
        for req_id, start, n in positions:
            table = self._requests[req_id].tables[group]
            blocks += [table[p // bs] for p in range(start, start + n)]
            offsets += [p % bs for p in range(start, start + n)]
        torch = self.model.torch
        device = self.model.device  # where the scatter runs, as the read index (no host-to-device copy per layer)
        return torch.tensor(blocks, device=device), torch.tensor(offsets, device=device)

    def _read_index(self, sampling: list[tuple[str, int]], group: int, window: int | None) -> tuple[Any, Any, Any]:
        """What the sampling requests read in ``group``: blocks, and per token slot its request and position weight.

        Slot ``i * block_size + j`` of the gathered blocks belongs to request
        ``segment[...]``; slots outside a request's span (before its window,
        after its last token) count for ``len(sampling)``, a bucket dropped.
        The third tensor holds each slot's :func:`~.model.position_weights`.
        """
        bs, torch = self.block_size, self.model.torch
        ids: list[int] = []
        owners: list[int] = []
        counts: list[int] = []
        shifts: list[int] = []  # per request: a gathered slot's position minus its index among all gathered slots
        spans: list[int] = []  # per request: how many slots it gathered
        none = len(sampling)
        for r, (req_id, last) in enumerate(sampling):
            first = 0 if window is None else max(0, last - window + 1)
            table = self._requests[req_id].tables[group][first // bs : last // bs + 1]
            shifts.append((first // bs - len(ids)) * bs)
            spans.append(len(table) * bs)
            ids += table
            lo, length = first % bs, last - first + 1
            owners += [none, r, none]
            counts += [lo, length, len(table) * bs - lo - length]

        def index(values: list[int]) -> Any:
            return torch.tensor(values, dtype=torch.long, device=self.model.device)

        positions = torch.arange(len(ids) * bs, device=self.model.device) + index(shifts).repeat_interleave(
            index(spans)
        )
        return index(ids), index(owners).repeat_interleave(index(counts)), position_weights(positions)

    def num_requests(self) -> int:
        return len(self._requests)
