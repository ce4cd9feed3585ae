"""Requests of the reference engine."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from ..hashing import ROOT_HASH, hash_blocks

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    """A generation request; satisfies :class:`kvconn.ConnectorRequest`.

    ``block_hashes`` grows as tokens are appended, one hash per full block,
    with vLLM's extra keys (:func:`kvconn.hashing.block_extra_keys`):
    ``adapter`` names the LoRA adapter it runs under (which changes its KV),
    ``cache_salt`` the tenant whose cached prefixes it may share (which does not).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        block_size: int,
        *,
        adapter: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.adapter, self.cache_salt = adapter, cache_salt
        self.block_hashes: list[bytes] = hash_blocks(
            self.all_token_ids, block_size, adapter=adapter, cache_salt=cache_salt
        )
        #: external tokens being loaded asynchronously (WAITING_FOR_REMOTE_KVS)
        self.num_external_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            start = len(self.block_hashes) * self.block_size
            self.block_hashes.extend(
                hash_blocks(
                    self.all_token_ids,
                    self.block_size,
                    parent=parent,
                    start=start,
                    adapter=self.adapter,
                    cache_salt=self.cache_salt,
                )
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
