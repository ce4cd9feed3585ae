"""One full ``vllm.LLM`` run of the shared-prefix workload; prints ``RESULT <json>``.

Run as a script (vLLM's engine core and workers start with spawn, so the entry
point is guarded): ``python engine_run.py SPEC_JSON``. SPEC keys: ``model``
(a model directory), ``connector`` (``None`` for no connector, a name or a list),
``config`` (``kvconn_config``), ``short_name`` (load through vLLM's registry
name ``"kvconn"`` instead of the module path), ``tp`` (tensor-parallel size).

The workload is as untidy as production: prompts sharing a prefix whose
length ends mid-block, chunked prefill with chunks ending mid-block, one
request that finishes on its block-fill step, then a concurrent flood that
vLLM must preempt and that evicts the shared prefix from vLLM's cache, then the prompts again,
which only a connector can serve. Greedy decoding: tokens are deterministic.
"""

from __future__ import annotations

import json
import sys
from typing import Any

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MAX_TOKENS = 16
FLOOD_MAX_TOKENS = 200
#: 64 blocks of 2 layers x 2 KV heads x 32 x fp32: the flood cannot fit beside the prefix.
KV_CACHE_BYTES = 64 * BLOCK_SIZE * 2 * 2 * 2 * 32 * 4


def workload() -> tuple[list[list[int]], list[list[int]]]:
    """``(prompts, flood)``: 4 prompts on a 300-token prefix (9.4 blocks), 6 unrelated prompts."""
    prefix = [(j * 13) % 1000 + 3 for j in range(300)]
    # 337 + 16 - 1 = 352 computed tokens: the first prompt ends on its block-fill step.
    prompts = [prefix + [(i * 31 + j) % 1000 + 3 for j in range(37 + 5 * i)] for i in range(4)]
    flood = [[(i * 97 + j * 7) % 1000 + 3 for j in range(300)] for i in range(6)]
    return prompts, flood


def transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    if not spec.get("connector"):
        return None
    extra = {"kvconn_connector": spec["connector"], "kvconn_on_error": "raise"}
    if spec.get("config") is not None:
        extra["kvconn_config"] = spec["config"]
    if spec.get("short_name"):
        return {"kv_connector": "kvconn", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return {
        "kv_connector": "KVConnVllmConnector",
        "kv_connector_module_path": "kvconn_vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=200,  # chunks of 200 tokens: boundaries mid-block
        enable_prefix_caching=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES // spec.get("tp", 1),  # per worker: each holds 1/tp of the heads
        tensor_parallel_size=spec.get("tp", 1),
        disable_log_stats=False,
        kv_transfer_config=transfer_config(spec),
    )
    prompts, flood = workload()

    def generate(batch: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    # The flood is admitted whole (60 of 64 blocks), then decodes until its requests outgrow the cache
    # (96 blocks): vLLM preempts, and its blocks evict the shared prefix.
    first, _, again = generate(prompts), generate(flood, FLOOD_MAX_TOKENS), generate(prompts)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    return {
        "first": first,
        "again": again,
        "external_hits": metrics.get("vllm:external_prefix_cache_hits", 0),
        "local_hits": metrics.get("vllm:prefix_cache_hits", 0),
        "preemptions": metrics.get("vllm:num_preemptions", 0),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
