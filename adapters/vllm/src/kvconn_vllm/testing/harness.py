"""vLLM's real v1 ``Scheduler`` on the CPU, with kvconn connectors, and nothing else.

No GPU, no model weights, no hub: ``ModelConfig`` points at a directory
holding a tiny OPT ``config.json``. Used by the vLLM test tier and by the
``vllm`` conformance driver. :class:`VllmLoop` runs a real worker-side
:class:`KVConnVllmConnector` on fake KV tensors next to the scheduler, passing
each step's ``SchedulerOutput`` through ``pickle`` as vLLM's ``MessageQueue``
does.

Environment: the first ``VllmConfig`` built with an empty ``VLLM_CACHE_ROOT``
inspects the model class in a subprocess (~10 s); later builds take ~0.2 s.
:func:`prepare_environment` points ``VLLM_CACHE_ROOT`` (unless set) at a
persistent folder, ``$XDG_CACHE_HOME/kvconn/vllm`` by default, and sets
``HF_HUB_OFFLINE``. It must run before vLLM is imported.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconn.context import NULL_BLOCK_ID, KVCacheGroupSpec
from kvconn.errors import ConnectorLoadError
from kvconn.install import checkout_path
from kvconn.reference.shape import EngineShape

from ..registration import CONNECTOR_CLASS, SHORT_NAME

__all__ = [
    "EOS_TOKEN_ID",
    "Rank",
    "RUNNERS",
    "RUNNER_VARIABLE",
    "VLLM_TEST_SHAPE",
    "VllmLoop",
    "fake_kv_caches",
    "kvconn_transfer_config",
    "make_model_runner_output",
    "make_request",
    "check_ranks",
    "make_scheduler",
    "model_runner",
    "prepare_environment",
    "require_vllm",
    "vllm_import_error",
]

#: vLLM 0.33's model runners, and the value of :data:`RUNNER_VARIABLE` that picks each.
RUNNERS = {"v1": "0", "v2": "1"}
RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
EOS_TOKEN_ID = 50256  # OPT's end-of-sequence token: sampling it ends a request
NUM_KV_HEADS, HEAD_SIZE = 2, 32
LAYERS = ("model.decoder.layers.0.self_attn.attn", "model.decoder.layers.1.self_attn.attn")
#: One full-attention group over the tiny model's layers: vLLM's KV cache layout for it.
DEFAULT_GROUPS = (KVCacheGroupSpec(LAYERS),)
#: The vLLM tier's engine: a pool and a token budget small enough that its tests fill the pool and chunk
#: prefills; the KV shape and layers are the tiny model's.
VLLM_TEST_SHAPE = EngineShape(
    num_blocks=128,
    max_num_batched_tokens=64,
    max_num_seqs=16,
    max_model_len=1024,
    kv_cache_groups=DEFAULT_GROUPS,
    num_kv_heads=NUM_KV_HEADS,
    head_dim=HEAD_SIZE,
)

_TINY_OPT = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "hidden_size": 64,
    "ffn_dim": 128,
    "word_embed_proj_dim": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": NUM_KV_HEADS,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "do_layer_norm_before": True,
    "enable_bias": True,
    "torch_dtype": "float16",
}


def vllm_import_error() -> str | None:
    """Why vLLM's scheduler cannot be imported here, or ``None`` when it can."""
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as exc:  # vLLM raises more than ImportError when half installed
        return f"{type(exc).__name__}: {exc}"
    return None


#: Builds a venv with vLLM's scheduler (``scheduler``) or full CPU engine (``engine``), relative to the checkout.
_VENV_SCRIPT = "scripts/install-vllm-venv.sh"


def require_vllm() -> None:
    """:func:`prepare_environment`, then a :class:`~kvconn.errors.ConnectorLoadError` saying how to get vLLM when
    its scheduler cannot be imported: what the entry points into this rig call first."""
    prepare_environment()
    error = vllm_import_error()
    if error is not None:
        script = checkout_path(_VENV_SCRIPT) or f"{_VENV_SCRIPT} (in a kvconn checkout)"
        raise ConnectorLoadError(
            f"vLLM is not installed in this environment: {error} "
            f"(build a venv with it: {script} scheduler, then run kvconn from that venv)"
        )


def prepare_environment(workdir: str | os.PathLike[str] | None = None) -> Path:
    """Offline env, a persistent ``VLLM_CACHE_ROOT`` and the tiny model; the model dir."""
    root = (
        Path(workdir) if workdir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvconn" / "vllm"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model_dir = root / "tiny-opt"
    model_dir.mkdir(parents=True, exist_ok=True)
    config = model_dir / "config.json"
    if not config.exists():
        config.write_text(json.dumps(_TINY_OPT))
    return model_dir


@functools.cache
def _init_hashing() -> None:
    """vLLM's ``NONE_HASH`` for SHA-256 block hashing, once per process."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def kvconn_transfer_config(
    connector: str | Sequence[str],
    config: Any = None,
    *,
    on_error: str = "raise",
    short_name: bool = False,
    stall_s: float = 0,
) -> dict[str, Any]:
    """``KVTransferConfig`` fields that load kvconn ``connector`` through the adapter.

    ``stall_s``: the host's stall bound in wall time beside its steps; by default ``0``, the steps alone (a
    test's steps are its measure). The conformance drivers pass the suite's wait bound
    (:func:`~kvconn.testing.conformance.waits.wait_seconds`), as the reference driver does: a delayed free
    reported half a second later is in time however many busy steps pass meanwhile.
    """
    names = connector if isinstance(connector, str) else list(connector)
    extra: dict[str, Any] = {"kvconn_connector": names, "kvconn_on_error": on_error, "kvconn_stall_s": stall_s}
    if config is not None:
        extra["kvconn_config"] = config
    fields: dict[str, Any] = {"kv_connector": CONNECTOR_CLASS, "kv_connector_extra_config": extra}
    if short_name:
        fields["kv_connector"] = SHORT_NAME
    else:
        fields["kv_connector_module_path"] = "kvconn_vllm"
    return fields


def make_scheduler(
    connector: str | Sequence[str] | None,
    config: Any = None,
    *,
    on_error: str = "raise",
    short_name: bool = False,
    kv_load_failure_policy: str = "recompute",
    workdir: str | os.PathLike[str] | None = None,
    shape: EngineShape | None = None,
    runner: str | None = None,
    transfer_fields: dict[str, Any] | None = None,
    stall_s: float = 0,
    **shape_options: Any,
) -> Any:
    """vLLM's ``Scheduler`` with kvconn ``connector`` (``None``: none) on its scheduler side (``scheduler.connector``).

    ``transfer_fields``, instead of ``connector``, are the ``KVTransferConfig``
    fields of any vLLM connector (``kv_connector``, ``kv_connector_module_path``,
    ``kv_connector_extra_config``). ``stall_s``: the kvconn host's stall bound in wall time
    (:func:`kvconn_transfer_config`).

    ``shape`` (default :data:`VLLM_TEST_SHAPE`) and ``shape_options``
    (``num_blocks=``... any :class:`~kvconn.reference.EngineShape` field) size
    it; ``kv_cache_groups`` lays out the KV cache (layer names; a sliding
    window makes a sliding-window group), and the KV shape must be the tiny
    model's; ``tp_size`` ranks split its heads (the KV-cache config holds one
    rank's, as vLLM's does), and :class:`VllmLoop` runs a worker per rank. With
    several groups vLLM's hybrid KV cache manager runs: vLLM
    turns it off on CPU platforms only because its GPU kernels need it, so it
    is switched back on here, where only the scheduler runs.

    ``runner`` (``"v1"``, ``"v2"``; ``None``: what vLLM picks, or
    ``VLLM_USE_V2_MODEL_RUNNER``) is the model runner whose scheduler output
    vLLM builds (``Scheduler.use_v2_model_runner``): under V2 a request
    resumed after preemption comes back in ``scheduled_new_reqs`` with its
    whole table, under V1 in ``resumed_req_ids``. :class:`VllmLoop` drives the
    worker as that runner does. Chosen through vLLM's own switch, the
    environment variable, while the config and scheduler are built.
    """
    shape = EngineShape.from_options(shape or VLLM_TEST_SHAPE, **shape_options)
    if (shape.num_kv_heads, shape.head_dim) != (NUM_KV_HEADS, HEAD_SIZE):
        raise ValueError(
            f"the vLLM harness's tiny model has {NUM_KV_HEADS} KV heads of {HEAD_SIZE}, not "
            f"num_kv_heads={shape.num_kv_heads}, head_dim={shape.head_dim}: leave them at VLLM_TEST_SHAPE's"
        )
    block_size, num_blocks, max_model_len = shape.block_size, shape.num_blocks, shape.max_model_len
    model_dir = prepare_environment(workdir)
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=max_model_len,
    )
    with model_runner(runner):  # VllmConfig reads its use_v2_model_runner while it is built
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                # vLLM refuses more running requests than tokens per step; every running request takes at
                # least one token a step, so the reference engine never runs more either.
                max_num_seqs=min(shape.max_num_seqs, shape.max_num_batched_tokens),
                max_num_batched_tokens=shape.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=model_config.is_encoder_decoder,
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=shape.enable_prefix_caching),
            kv_transfer_config=None
            if connector is None and transfer_fields is None
            else KVTransferConfig(
                kv_role="kv_both",
                kv_load_failure_policy=kv_load_failure_policy,
                **(
                    kvconn_transfer_config(connector, config, on_error=on_error, short_name=short_name, stall_s=stall_s)
                    if connector is not None
                    else transfer_fields or {}
                ),
            ),
            device_config=DeviceConfig("cpu"),
            # every rank's worker runs in this process (VllmLoop), as under vLLM's external launcher
            parallel_config=ParallelConfig(
                tensor_parallel_size=shape.tp_size,
                distributed_executor_backend="external_launcher" if shape.tp_size > 1 else None,
            ),
        )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    _record_kv_cache_layout(vllm_config)
    if len(shape.kv_cache_groups) > 1:
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[_vllm_group(group, block_size, shape.heads_per_rank) for group in shape.kv_cache_groups],
    )
    _init_hashing()
    with model_runner(runner):  # and the scheduler keeps the runner it reads now (use_v2_model_runner)
        return Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            log_stats=True,
        )


@contextlib.contextmanager
def model_runner(runner: str | None) -> Iterator[None]:
    """Make vLLM configs built inside pick ``runner`` (see :data:`RUNNERS`; ``None``: leave the choice to vLLM)."""
    if runner is None:
        yield
        return
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)} (vLLM's model runners), not {runner!r}")
    previous = os.environ.get(RUNNER_VARIABLE)
    os.environ[RUNNER_VARIABLE] = RUNNERS[runner]
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUNNER_VARIABLE, None)
        else:
            os.environ[RUNNER_VARIABLE] = previous


def _vllm_group(group: KVCacheGroupSpec, block_size: int, num_kv_heads: int) -> Any:
    """vLLM's ``KVCacheGroupSpec`` for a kvconn one: full attention, or a sliding window.

    ``num_kv_heads``: one rank's heads (vLLM's specs, and the scheduler's KV-cache config, are per rank).
    """
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VllmGroupSpec

    shape: dict[str, Any] = {
        "block_size": block_size, "num_kv_heads": num_kv_heads, "head_size": HEAD_SIZE, "dtype": torch.float16,
    }  # fmt: skip
    if group.sliding_window is None:
        return VllmGroupSpec(list(group.layer_names), FullAttentionSpec(**shape))
    return VllmGroupSpec(list(group.layer_names), SlidingWindowSpec(**shape, sliding_window=group.sliding_window))


def _record_kv_cache_layout(vllm_config: Any) -> None:
    """Adopt the KV cache layout, as vLLM 0.33's workers do before any connector exists.

    vLLM's engine core resolves the layout and each worker records it in the cache config
    (``WorkerBase.set_kv_cache_layout`` -> ``record_kv_cache_layout``); connectors read it there
    (LMCache's does). The harness's KV caches are ``[blocks, heads, block_size, K|V]`` per layer:
    vLLM's ``LBHNC``, the CPU backend's. A vLLM without layouts (0.29) has nothing to record.
    """
    try:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
    except ImportError:
        return
    record_kv_cache_layout(vllm_config.cache_config, "LBHNC")


def check_ranks(shape: EngineShape) -> None:
    """Refuse (``ScenarioUnsupported``) a tensor-parallel shape whose ranks cannot split the tiny model's heads.

    :class:`VllmLoop` runs one worker per rank, each with its shard of the tiny model's
    :data:`NUM_KV_HEADS` heads, so ``tp_size`` must divide them.
    """
    from kvconn.testing.conformance import ScenarioUnsupported

    if NUM_KV_HEADS % shape.tp_size:
        raise ScenarioUnsupported(
            f"vLLM's test harness has a model of {NUM_KV_HEADS} KV heads, which tp_size={shape.tp_size} ranks "
            "cannot split: tensor parallelism beyond that is checked on the reference engine (kvconn validate NAME)"
        )


def make_request(
    req_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int = 16,
    block_size: int = 16,
    *,
    adapter: str | None = None,
    cache_salt: str | None = None,
) -> Any:
    """A vLLM ``Request`` with SHA-256 block hashing (so prefix caching works).

    ``adapter`` names a LoRA adapter (a ``LoRARequest``; vLLM's scheduler needs no LoRA config to
    schedule it, and puts it in every block hash), ``cache_salt`` a tenant (in block 0's hash).
    """
    _init_hashing()
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    lora = None
    if adapter is not None:  # vLLM hashes the path with the name and never reads it here: no weights are loaded
        adapter_id = _adapter_ids.setdefault(adapter, len(_adapter_ids) + 1)
        lora = LoRARequest(adapter, adapter_id, f"kvconn-test-adapters/{adapter}")
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        lora_request=lora,
        cache_salt=cache_salt,
    )


#: A LoRA adapter's integer id, per name (vLLM's ``LoRARequest`` wants one, positive and stable).
_adapter_ids: dict[str, int] = {}


def make_model_runner_output(
    scheduler_output: Any,
    scheduler: Any,
    *,
    sampled_token: int = 0,
    eos_req_ids: Iterable[str] = (),
    kv_connector_output: Any = None,
) -> Any:
    """A model runner's answer without a model: requests done with their prompt sample one token.

    ``schedule()`` has already advanced ``num_computed_tokens``, so a request
    is mid-prefill iff it is still below ``num_tokens``.
    """
    from vllm.v1.outputs import ModelRunnerOutput

    eos = set(eos_req_ids)
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        partial = request is not None and request.num_computed_tokens < request.num_tokens
        sampled.append([] if partial else [EOS_TOKEN_ID if req_id in eos else sampled_token])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_connector_output,
    )


def _with_kvconn_config(vllm_config: Any, config: Any) -> Any:
    """A shallow copy of ``vllm_config`` whose kvconn connector gets ``config`` (a worker configured apart)."""
    import copy

    transfer = copy.copy(vllm_config.kv_transfer_config)
    transfer.kv_connector_extra_config = {**transfer.kv_connector_extra_config, "kvconn_config": config}
    copied = copy.copy(vllm_config)
    copied.kv_transfer_config = transfer
    return copied


def _kvconn_worker(vllm_config: Any, *, kv_cache_config: Any) -> Any:
    """kvconn's adapter on the worker side, built from one rank's config."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ..connector import KVConnVllmConnector

    return KVConnVllmConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def fake_kv_caches(
    num_blocks: int, block_size: int = 16, layers: Iterable[str] = LAYERS, num_kv_heads: int = NUM_KV_HEADS
) -> dict[str, Any]:
    """Per-layer tensors shaped as vLLM 0.33 registers them: ``[blocks, heads, block_size, 2 * head]``.

    ``num_kv_heads``: the heads of one rank (all of them with one rank).
    """
    import torch

    shape = (num_blocks, num_kv_heads, block_size, 2 * HEAD_SIZE)
    return {name: torch.zeros(shape, dtype=torch.float16) for name in layers}


@dataclass
class Rank:
    """One tensor-parallel worker of :class:`VllmLoop`: its connector worker side, its shard of the KV caches."""

    index: int
    #: the worker-side connector, built with this rank's config (``parallel_config.rank``) and TP group
    worker: Any
    #: per layer, ``[blocks, heads of this rank, block_size, 2 * head]``
    kv_caches: dict[str, Any]
    #: V2's ``ActiveKVConnector`` of this rank (``None`` under V1)
    active: Any = None


@contextlib.contextmanager
def tp_group(rank: int, size: int) -> Iterator[None]:
    """vLLM's tensor-parallel group as rank ``rank`` of ``size`` sees it (``get_tensor_model_parallel_rank()``).

    vLLM's workers each initialise their own process group; the harness runs every rank in one process, so
    the group vLLM's code reads (``parallel_state._TP``) is this rank's for the duration: its
    ``rank_in_group`` and ``world_size`` only (no communicator: a connector that exchanges tensors between
    ranks cannot run here). With one rank nothing is set: connectors then see no distributed state, as in a
    single-process vLLM without one.
    """
    if size == 1:
        yield
        return
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    previous = parallel_state._TP
    parallel_state._TP = SimpleNamespace(rank_in_group=rank, world_size=size)
    try:
        yield
    finally:
        parallel_state._TP = previous


def _rank_config(vllm_config: Any, rank: int) -> Any:
    """A shallow copy of ``vllm_config`` whose ``parallel_config.rank`` is ``rank`` (as vLLM's ``WorkerBase`` sets)."""
    import copy

    if vllm_config.parallel_config.world_size == 1:
        return vllm_config
    parallel = copy.copy(vllm_config.parallel_config)
    parallel.rank = rank
    copied = copy.copy(vllm_config)
    copied.parallel_config = parallel
    return copied


class VllmLoop:
    """vLLM's scheduler plus a real worker-side adapter instance per tensor-parallel rank on fake KV caches.

    Each :meth:`step` does what vLLM's engine core and model runner do around
    a connector: ``schedule()``, pickle the output (the multiprocess
    executor's ``MessageQueue``), run the worker side of the step through
    vLLM's own model-runner code (:meth:`run_worker`), then
    ``update_from_output``. The "model" writes, for each computed token, a
    value derived from the token ids up to it, so a block's bytes depend on
    its whole prefix and a load can be checked against a save.

    With ``tensor_parallel_size`` > 1 in the scheduler's config, every rank
    (:class:`Rank`) runs the step in turn, each with its own worker-side
    connector built as vLLM builds one (its ``parallel_config.rank`` and TP
    group, :func:`tp_group`) on its shard of the heads, and their outputs are
    combined by vLLM's ``KVOutputAggregator``, as vLLM's executor combines its
    workers' for the scheduler.
    """

    def __init__(
        self, scheduler: Any, *, worker_config: Any = None, make_worker: Callable[[Any], Any] | None = None
    ) -> None:
        """``make_worker(vllm_config)``: a rank's worker-side connector, from that rank's config (default: a kvconn
        adapter, with ``worker_config`` as its kvconn config when given)."""
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

        self.scheduler = scheduler
        self.block_size = scheduler.block_size
        num_blocks = scheduler.kv_cache_config.num_blocks
        config = scheduler.vllm_config
        if worker_config is not None:
            config = _with_kvconn_config(config, worker_config)
        if make_worker is None:
            make_worker = functools.partial(_kvconn_worker, kv_cache_config=scheduler.kv_cache_config)
        #: per KV-cache group, the names of its layers
        self.group_layers = [tuple(g.layer_names) for g in scheduler.kv_cache_config.kv_cache_groups]
        self._group_of = {layer: i for i, layers in enumerate(self.group_layers) for layer in layers}
        layer_names = [n for g in self.group_layers for n in g]
        heads = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads  # one rank's (vLLM's spec)
        self.tp_size = int(config.parallel_config.tensor_parallel_size)
        # What vLLM's attention layers expose to its KV-transfer decorator: each layer's cache (the running rank's).
        self._layers = scheduler.vllm_config.compilation_config.static_forward_context
        self._attention = maybe_transfer_kv_layer(self._layer_forward)
        self._step_writes: list[list[tuple[int, int, float]]] = []
        #: the model runner whose worker code drives the connector: the one the scheduler builds outputs for
        self.runner = "v2" if scheduler.use_v2_model_runner else "v1"
        self.ranks: list[Rank] = []
        for index in range(self.tp_size):
            rank_config = _rank_config(config, index)
            with tp_group(index, self.tp_size):
                kv_caches = fake_kv_caches(num_blocks, self.block_size, layer_names, heads)
                rank = Rank(index, make_worker(rank_config), kv_caches)
            self.ranks.append(rank)
            with self._agent(rank):
                if self.runner == "v2":  # V2's runner registers the caches through its ActiveKVConnector
                    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

                    rank.active = ActiveKVConnector(rank_config, rank.kv_caches)
                else:  # V1's (initialize_kv_cache) registers them with the transfer group itself
                    rank.worker.register_kv_caches(rank.kv_caches)
        self._rank = self.ranks[0]  # the rank whose step is running
        #: rank 0's worker-side connector and KV caches (the only ones with one rank)
        self.worker, self.kv_caches = self._rank.worker, self._rank.kv_caches
        self._aggregator: Any = None
        if self.tp_size > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            self._aggregator = KVOutputAggregator.from_connector(self.worker, self.tp_size)
        self.outputs: list[Any] = []
        self.last_kv_output: Any = None

    def token_value(self, token_ids: Sequence[int], position: int) -> float:
        """What the fake model writes for the token at ``position`` (depends on the prefix)."""
        return float(hash(tuple(token_ids[: position + 1])) % 997)

    def _writes(self, output: Any) -> list[list[tuple[int, int, float]]]:
        """Per KV-cache group, ``(block, offset, value)`` of every token this step computes (null blocks skipped)."""
        writes: list[list[tuple[int, int, float]]] = [[] for _ in self.group_layers]
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            start = request.num_computed_tokens - n
            tokens = list(request.all_token_ids)
            for pos in range(start, start + n):
                value = self.token_value(tokens, pos)
                for table, group in zip(tables, writes, strict=True):
                    block = table[pos // self.block_size]
                    if block != NULL_BLOCK_ID:  # else a sliding window already dropped this position
                        group.append((block, pos % self.block_size, value))
        return writes

    def _layer_forward(self, layer_name: str) -> None:
        """One attention layer of the fake model: write this step's KV into ``layer_name``'s cache."""
        kv = self._rank.kv_caches[layer_name]
        for block, offset, value in self._step_writes[self._group_of[layer_name]]:
            kv[block, :, offset, :] = value

    def step(self, *, eos_req_ids: Iterable[str] = (), inspect: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
        """One engine step; returns ``(scheduler_output, engine_core_outputs)``.

        ``inspect(output)`` runs right after ``schedule()``, while the
        scheduler's tables are exactly those the connectors were offered.
        """
        output = self.scheduler.schedule()
        if inspect is not None:
            inspect(output)
        sent = pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
        self._step_writes = self._writes(output)  # from the scheduler's live requests, before the step advances them
        kv_output = self.last_kv_output = self.run_worker(sent)
        self.outputs.append(output)
        runner_output = self.runner_output(output, eos_req_ids, kv_output)
        return output, self.scheduler.update_from_output(output, runner_output)

    def runner_output(self, output: Any, eos_req_ids: Iterable[str], kv_output: Any) -> Any:
        """The model runner's answer to the step (:func:`make_model_runner_output`: every sampled token is 0)."""
        return make_model_runner_output(output, self.scheduler, eos_req_ids=eos_req_ids, kv_connector_output=kv_output)

    @contextlib.contextmanager
    def _agent(self, rank: Rank) -> Iterator[None]:
        """``rank`` as vLLM's worker sees itself: its connector as the KV-transfer group (what vLLM's model-runner
        code reads), its TP group, its KV caches on the attention layers."""
        from types import SimpleNamespace

        from vllm.distributed.kv_transfer import kv_transfer_state

        self._rank = rank
        self._layers.update({name: SimpleNamespace(kv_cache=kv) for name, kv in rank.kv_caches.items()})
        previous, kv_transfer_state._KV_CONNECTOR_AGENT = kv_transfer_state._KV_CONNECTOR_AGENT, rank.worker
        try:
            with tp_group(rank.index, self.tp_size):
                yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = previous

    def run_worker(self, output: Any) -> Any:
        """The worker side of one step on every rank, as vLLM's executor runs its workers (:meth:`run_rank`).

        With several ranks, their outputs are combined by vLLM's ``KVOutputAggregator`` (a transfer is finished
        once every rank reported it; invalid blocks and worker metadata of all ranks).
        """
        if self._aggregator is None:
            return self.run_rank(self.ranks[0], output)
        from vllm.v1.outputs import ModelRunnerOutput

        outputs = [
            ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=self.run_rank(rank, output))
            for rank in self.ranks
        ]
        return self._aggregator.aggregate(outputs).kv_connector_output

    def run_rank(self, rank: Rank, output: Any) -> Any:
        """The worker side of one step on ``rank``, driven by vLLM's own model-runner code, not by an order written
        here.

        Under V2 (:attr:`runner`), vLLM's ``ActiveKVConnector`` (what
        ``GPUModelRunner`` calls): ``pre_forward`` inside the forward context
        (binds the metadata; starts loads now only for sync loads),
        the layers, ``finish_forward``, ``post_forward`` (starts the other
        loads, ``wait_for_save``, transfer results, invalid blocks, worker
        metadata), or ``no_forward`` on a step without tokens. The runner's
        ``InputBatch`` (CUDA tensors) is not built: ``pre_forward`` gets none,
        so ``start_load_kv`` gets no per-request keyword arguments (kvconn's
        adapter reads none). Under V1, vLLM's ``KVConnectorModelRunnerMixin``
        binds the metadata and calls
        ``handle_preemptions`` first (as ``GPUModelRunner.execute_model``), then
        ``start_load_kv`` (before the forward only when the step has sync
        loads, else after it), ``wait_for_save``, ``get_transfer_results`` and
        the rest; each layer runs through vLLM's ``maybe_transfer_kv_layer``
        decorator (``wait_for_layer_load``, the layer, ``save_kv_layer``), as
        its attention layers do. A step with no scheduled tokens takes vLLM's
        no-forward path.
        """
        from vllm.forward_context import set_forward_context
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as Runner

        config = self.scheduler.vllm_config
        attn_metadata = dict.fromkeys(rank.kv_caches, output)  # any non-None per-layer metadata
        with self._agent(rank):
            if rank.active is not None:
                if not output.total_num_scheduled_tokens:
                    return rank.active.no_forward(output).kv_connector_output
                with set_forward_context(attn_metadata, config, slot_mapping={}):
                    rank.active.pre_forward(output)
                    for layer in rank.kv_caches:
                        self._attention(layer)
                rank.active.finish_forward()
                return rank.active.post_forward(output.finished_req_ids)
            # GPUModelRunner.execute_model lets the connector finish with preempted requests' blocks first (V2's
            # pre_forward does the same): this step's forward may reuse them
            rank.worker.handle_preemptions(output.kv_connector_metadata)
            if not output.total_num_scheduled_tokens:
                return Runner.kv_connector_no_forward(output, config).kv_connector_output
            with (
                set_forward_context(attn_metadata, config, slot_mapping={}),
                Runner.maybe_get_kv_connector_output(output) as kv_output,
            ):
                for layer in rank.kv_caches:
                    self._attention(layer)
            return kv_output

    def shutdown(self) -> None:
        """Shut every rank's worker-side connector down (a vLLM connector without ``shutdown`` has nothing to)."""
        for rank in self.ranks:
            shutdown = getattr(rank.worker, "shutdown", None)
            if callable(shutdown):
                with self._agent(rank):
                    shutdown()

    def run(self, *, max_steps: int = 1000, inspect: Callable[[Any], None] | None = None) -> None:
        """Step until the scheduler has nothing left (requests or held blocks)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step(inspect=inspect)
        raise AssertionError(f"vLLM scheduler still has requests after {max_steps} steps")
