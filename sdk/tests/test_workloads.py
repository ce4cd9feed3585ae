"""The workload generators: seeded, and shaped as their names say."""

from __future__ import annotations

import pytest

from kvconn.reference.workloads import WORKLOADS, make_workload, reusable_prompt_tokens


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_same_seed_same_prompts_other_seed_other_prompts(name: str) -> None:
    a, b, c = make_workload(name, 12, seed=1), make_workload(name, 12, seed=1), make_workload(name, 12, seed=2)
    assert a == b
    assert [r.prompt for r in a.requests] != [r.prompt for r in c.requests]
    assert len(a.requests) == 12 and a.name == name


def test_shared_prefix_requests_share_a_few_system_prompts() -> None:
    workload = make_workload("shared-prefix", 64, seed=0)
    systems = {tuple(r.prompt[:384]) for r in workload.requests}  # system prompts are >= 384 tokens
    assert 1 < len(systems) <= 8
    assert len({tuple(r.prompt) for r in workload.requests}) == 64  # every user message differs
    arrivals = [r.arrival_step for r in workload.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_multi_turn_prompts_grow_from_the_previous_turn() -> None:
    workload = make_workload("multi-turn", 10, seed=0)  # 3 conversations, the last turn has one
    turns = [r for r in workload.requests if r.after is not None]
    assert len(turns) == 7
    for request in turns:
        previous = workload.requests[request.after]  # type: ignore[index]
        assert request.prompt[: len(previous.prompt)] == previous.prompt
        # output-like tokens (max_tokens of them) then a new user message
        assert len(request.prompt) > len(previous.prompt) + request.max_tokens


def test_long_document_questions_share_the_document_and_come_in_turn() -> None:
    workload = make_workload("long-document", 8, seed=0)  # 2 documents x 4 questions
    for i, request in enumerate(workload.requests):
        assert request.after == (i - 2 if i >= 2 else None)
        assert request.prompt[:1536] == workload.requests[i % 2].prompt[:1536]
    assert workload.requests[0].prompt[:1536] != workload.requests[1].prompt[:1536]


def test_reusable_prompt_tokens_counts_whole_block_prefixes_seen_before() -> None:
    shared = list(range(32))
    prompts = [[*shared, 100, 101], [*shared, 200], list(range(50, 60)), shared]
    # second: 2 blocks; third: nothing; fourth: 2 blocks seen, but the last token must be computed -> 1 block
    assert reusable_prompt_tokens(prompts, block_size=16) == 32 + 0 + 16


def test_unknown_workload_and_bad_size_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload 'chat'; choose one of: shared-prefix"):
        make_workload("chat", 4)
    with pytest.raises(ValueError, match="at least 1 request"):
        make_workload("multi-turn", 0)
