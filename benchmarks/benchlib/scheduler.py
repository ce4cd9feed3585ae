"""kvconn's reference scheduler in decode: the step a connector's or the host's cost is set against.

``scheduler_scaling.py`` measures the step itself; ``host_dispatch.py`` sets
the host's cost against it.
"""

from __future__ import annotations

import random
import time

from kvconn.reference import Scheduler
from kvconn.testing import create_requests, create_scheduler, make_model_runner_output

__all__ = ["BLOCK_SIZE", "decode_scheduler", "decode_step_seconds"]

BLOCK_SIZE = 16


def decode_scheduler(num_running: int, context_len: int, *, seed: int = 0) -> Scheduler:
    """A scheduler with ``num_running`` requests in decode, each about ``context_len`` tokens long.

    Prompts vary by up to one block so block-allocating steps are spread out.
    """
    rng = random.Random(seed)
    blocks = num_running * (context_len // BLOCK_SIZE + 8)
    scheduler = create_scheduler(
        block_size=BLOCK_SIZE,
        num_blocks=blocks + 1,
        max_num_batched_tokens=num_running * (context_len + BLOCK_SIZE),
        max_num_seqs=num_running,
        max_model_len=context_len + 4 * BLOCK_SIZE + 256,
    )
    for i in range(num_running):
        prompt_len = context_len - rng.randrange(BLOCK_SIZE)
        (request,) = create_requests(1, prompt_len, max_tokens=200, seed=i, prefix=f"r{i}-")
        scheduler.add_request(request)
    output = scheduler.schedule()  # prefill everything in one step
    scheduler.update_from_output(output, make_model_runner_output(output, scheduler=scheduler))
    return scheduler


def decode_step_seconds(scheduler: Scheduler, steps: int = 32) -> float:
    """Mean seconds of one decode step (schedule + update) over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        output = scheduler.schedule()
        scheduler.update_from_output(output, make_model_runner_output(output))
    return (time.perf_counter() - start) / steps
