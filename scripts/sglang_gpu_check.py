"""An SGLang engine on a GPU with HiCache and kvconn's storage tier: exact tokens, and pages served from L3.

Part 4 of scripts/gpu-check.sh (needs a CUDA build of SGLang: KVCONN_SGLANG_PYTHON names its interpreter,
with kvconn-sdk, kvconn-sglang and kvconn-redis installed into it, and a redis-server). Nothing is downloaded:
the model is a 2-layer Llama with random weights written to a temporary directory.

Multi-turn chats (greedy) are run twice on fresh engines: with HiCache and no L3, and with HiCache whose L3
is the kvconn tier over Redis. The device KV pool and the host tier are both small, and the chats take turns,
so a chat's history has left both tiers when its next turn comes: only L3 can serve it. The two runs must give
the same tokens; the pages L3 served are counted from Redis's own ``keyspace_hits`` (each page a key read by
the tier's MGET) and the keys it holds. Prints one JSON line; exit 1 when the tokens differ or L3 served none.

Usage: KVCONN_REDIS_URL=redis://127.0.0.1:PORT/0 python scripts/sglang_gpu_check.py [--chats N] [--turns T]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

PAGE = 16


def tiny_llama(path: str) -> str:
    """The random 2-layer Llama of examples/vllm_offline.py (float32, sharp attention), written to ``path``."""
    import importlib.util

    example = Path(__file__).resolve().parents[1] / "examples" / "vllm_offline.py"
    spec = importlib.util.spec_from_file_location("vllm_offline", example)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written: str = module.tiny_llama(path)
    return written


def chats(n: int, turns: int) -> list[list[list[int]]]:
    """Per chat, the new tokens of each turn (512 a turn: 32 pages)."""
    return [[[(c * 131 + t * 17 + j) % 1000 + 3 for j in range(512)] for t in range(turns)] for c in range(n)]


def run(model: str, l3: dict[str, Any] | None, conversations: list[list[list[int]]]) -> list[list[int]]:
    import sglang

    options: dict[str, Any] = {
        "model_path": model, "dtype": "float32", "skip_tokenizer_init": True, "page_size": PAGE,
        "max_total_tokens": 4096,
        "enable_hierarchical_cache": True, "hicache_size": 0, "hicache_ratio": 2.0,
        "hicache_write_policy": "write_through", "disable_cuda_graph": True, "random_seed": 0,
    }  # fmt: skip
    if l3 is not None:
        options |= {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config": json.dumps(l3)}
    engine = sglang.Engine(**options)
    outputs: list[list[int]] = []
    history = [[] for _ in conversations]
    try:
        for turn in range(len(conversations[0])):
            for c, chat in enumerate(conversations):  # turns interleaved: the history leaves the device and host
                history[c] += chat[turn]
                out = engine.generate(input_ids=history[c], sampling_params={"max_new_tokens": 16, "temperature": 0.0})
                tokens = list(out["output_ids"])
                outputs.append(tokens)
                history[c] += tokens
    finally:
        engine.shutdown()
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    import redis

    from kvconn_sglang import extra_config

    url = os.environ.get("KVCONN_REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url)
    conversations = chats(args.chats, args.turns)
    with tempfile.TemporaryDirectory(prefix="kvconn-sglang-gpu-") as model:
        tiny_llama(model)
        plain = run(model, None, conversations)
        before = int(client.info("stats")["keyspace_hits"])
        with_l3 = run(model, extra_config("redis", {"url": url, "namespace": "gpu-check"}), conversations)
        hits = int(client.info("stats")["keyspace_hits"]) - before
    summary = {"tokens_match": plain == with_l3, "l3_pages_read": hits, "keys_stored": client.dbsize(),
               "requests": len(plain), "page_size": PAGE}  # fmt: skip
    print(json.dumps(summary))
    return 0 if summary["tokens_match"] and hits > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
