"""Engine regressions found with the shipped plugins."""

from __future__ import annotations

import random

from kvconn.reference import Engine


def test_finished_async_loads_holding_the_pool_do_not_stall_the_engine() -> None:
    """Requests back from async loads hold blocks while waiting; with nothing running, they must yield them."""
    rng = random.Random(0)
    batch = [[rng.randrange(32_000) for _ in range(100)] for _ in range(4)]
    with Engine(enable_prefix_caching=False) as plain:
        expected = plain.generate(batch, max_tokens=40)
    with Engine("offload", {"pool_blocks": 256}, num_blocks=24, enable_prefix_caching=False) as engine:
        assert engine.generate(batch, max_tokens=40) == expected
        assert engine.generate(batch, max_tokens=40) == expected  # now every prefix loads asynchronously
    assert engine.stats.preemptions > 0
