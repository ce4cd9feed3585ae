"""``python -m kvconn.demo``: the reference engine with a connector on a small workload.

Runs a shared-prefix workload twice, without and with the connector, checks
that the generated tokens are identical, and prints a summary.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from .engine import Engine


def shared_prefix_prompts(num_requests: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(32_000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(32_000) for _ in range(suffix_len)] for _ in range(num_requests)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--connector", default="dummy")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args(argv)
    prompts = shared_prefix_prompts(args.requests, prefix_len=200, suffix_len=40, seed=0)
    options: dict[str, Any] = {"num_blocks": 256, "max_num_batched_tokens": 256, "max_num_seqs": 8}
    baseline = Engine(**options).generate(prompts, max_tokens=8)
    start = time.perf_counter()
    with Engine(args.connector, **options) as engine:
        tokens = engine.generate(prompts, max_tokens=8)
    elapsed = time.perf_counter() - start
    print(f"connector {args.connector!r}: {len(prompts)} requests in {engine.stats.steps} steps, {elapsed:.2f}s")
    for key, value in engine.stats.as_dict().items():
        print(f"  {key:24} {value}")
    verified = tokens == baseline
    print("output verified: identical to a run without a connector" if verified else "OUTPUT MISMATCH")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
