"""Seeded, realistic request workloads for driving the reference engine.

A connector only earns its keep when prompts share prefixes across requests,
so each workload reproduces one way they do in real serving:

* ``shared-prefix``: many independent requests, each a system prompt (a few
  are shared by everyone) followed by a distinct user message;
* ``multi-turn``: conversations that grow; turn *k*'s prompt is turn *k-1*'s
  prompt, then output-like tokens standing in for the assistant's answer,
  then the new user message. A turn is submitted only once the previous turn
  of its conversation finished, as a user waits for the answer;
* ``long-document``: a long document asked several questions in turn, several
  documents at once.

Everything is drawn from ``random.Random(seed)``: the same name, size and seed
give the same prompts, so a run with a connector can be compared token for
token with a run without one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..hashing import hash_blocks
from .model import VOCAB_SIZE

__all__ = [
    "WORKLOADS",
    "Workload",
    "WorkloadRequest",
    "long_document",
    "make_workload",
    "multi_turn",
    "reusable_prompt_tokens",
    "shared_prefix",
]


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload.

    ``arrival_step``: the first engine step at which it may be submitted.
    ``after``: index of a request that must have finished before this one is
    submitted (the previous turn of a conversation), or ``None``.
    """

    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    after: int | None = None


@dataclass(frozen=True)
class Workload:
    """A named list of requests, in submission order (dependencies point backwards)."""

    name: str
    description: str
    seed: int
    requests: list[WorkloadRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def shared_prefix(
    num_requests: int,
    seed: int = 0,
    *,
    num_system_prompts: int = 8,
    system_tokens: tuple[int, int] = (384, 1024),
    user_tokens: tuple[int, int] = (16, 160),
    max_tokens: int = 16,
    arrival_gap: int = 2,
) -> Workload:
    """Requests sharing a few system prompts; the first prompts are the most used (Zipf-like)."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(*system_tokens)) for _ in range(num_system_prompts)]
    weights = [1.0 / (rank + 1) for rank in range(num_system_prompts)]
    requests = [
        WorkloadRequest(rng.choices(systems, weights)[0] + _tokens(rng, rng.randint(*user_tokens)), max_tokens, step)
        for step in _arrivals(rng, num_requests, arrival_gap)
    ]
    return Workload(
        "shared-prefix",
        f"{num_requests} requests over {num_system_prompts} shared system prompts",
        seed,
        requests,
    )


def multi_turn(
    num_requests: int,
    seed: int = 0,
    *,
    turns: int = 4,
    system_tokens: int = 256,
    user_tokens: tuple[int, int] = (32, 128),
    max_tokens: int = 32,
    arrival_gap: int = 3,
) -> Workload:
    """Conversations of ``turns`` turns (the last may be shorter) that share one system prompt.

    Turn k's prompt is turn k-1's prompt + ``max_tokens`` output-like tokens
    + a new user message; it waits for turn k-1 to finish.
    """
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    num_conversations = max(1, -(-num_requests // turns))
    prompts = [system + _tokens(rng, rng.randint(*user_tokens)) for _ in range(num_conversations)]
    starts = _arrivals(rng, num_conversations, arrival_gap)
    requests: list[WorkloadRequest] = []
    for turn in range(turns):
        for c in range(min(num_conversations, num_requests - len(requests))):
            if turn:
                prompts[c] = prompts[c] + _tokens(rng, max_tokens) + _tokens(rng, rng.randint(*user_tokens))
            requests.append(
                WorkloadRequest(prompts[c], max_tokens, starts[c], _previous_turn(requests, num_conversations))
            )
    return Workload(
        "multi-turn",
        f"{num_conversations} conversations of up to {turns} turns ({num_requests} requests)",
        seed,
        requests,
    )


def _arrivals(rng: random.Random, n: int, gap: int) -> list[int]:
    """Engine steps at which ``n`` requests arrive, ``0..gap`` steps apart."""
    steps, step = [], 0
    for _ in range(n):
        steps.append(step)
        step += rng.randint(0, gap)
    return steps


def _previous_turn(requests: Sequence[WorkloadRequest], num_threads: int) -> int | None:
    """Index of the previous turn of the request about to be appended (requests are turn-major)."""
    i = len(requests)
    return i - num_threads if i >= num_threads else None


def long_document(
    num_requests: int,
    seed: int = 0,
    *,
    questions: int = 4,
    document_tokens: tuple[int, int] = (1536, 3072),
    question_tokens: tuple[int, int] = (16, 64),
    max_tokens: int = 24,
) -> Workload:
    """Documents each asked ``questions`` questions in turn (a question waits for the previous answer)."""
    rng = random.Random(seed)
    num_documents = max(1, -(-num_requests // questions))
    documents = [_tokens(rng, rng.randint(*document_tokens)) for _ in range(num_documents)]
    requests: list[WorkloadRequest] = []
    for _ in range(questions):
        for d in range(num_documents):
            if len(requests) == num_requests:
                break
            question = documents[d] + _tokens(rng, rng.randint(*question_tokens))
            requests.append(WorkloadRequest(question, max_tokens, after=_previous_turn(requests, num_documents)))
    return Workload(
        "long-document",
        f"{num_documents} documents asked up to {questions} questions each ({num_requests} requests)",
        seed,
        requests,
    )


#: Workload generators by name: ``(num_requests, seed) -> Workload``.
WORKLOADS: dict[str, Callable[[int, int], Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "long-document": long_document,
}


def make_workload(name: str, num_requests: int, seed: int = 0) -> Workload:
    """The workload ``name`` with ``num_requests`` requests; ``ValueError`` naming the choices otherwise."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"a workload needs at least 1 request, got {num_requests}")
    return WORKLOADS[name](num_requests, seed)


def reusable_prompt_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens an ideal, unbounded prefix cache could serve, in submission order.

    Per request: the longest run of whole blocks that an earlier request's
    prompt also starts with (the engine's chained block hashes), leaving the
    last token to compute as an engine must. The ceiling for what any cache
    (local or connector) can save.
    """
    seen: set[bytes] = set()
    total = 0
    for prompt in prompts:
        hashes = hash_blocks(prompt, block_size)
        hits = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        seen.update(hashes)
        total += min(hits * block_size, (len(prompt) - 1) // block_size * block_size)
    return total
