"""Seeing what a connector acts on, from the metadata it sends.

Two ways, the explicit one first:

* **Introspection convention.** A ``Metadata`` Struct may define
  ``block_ids_by_request(self) -> Mapping[str, BlockIds | Sequence[int]]``:
  for each request, the block ids this step's metadata acts on. The checks
  then compare exactly that with the live tables.
* **Walking.** Otherwise the metadata is walked: a list of ints (or a scalar
  int field whose name says it is a block id) belongs to a request when it
  sits under a dict key that is the request's id, or in a Struct or dict
  with a string field equal to the request's id. Lists whose fields are
  named for tokens or hashes, holding values outside ``[0, num_blocks)`` or
  only tokens of the request, are not block ids. Block ids under no request
  are collected under ``None``.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

import msgspec

from ...block_state import KVConnectorBlockState
from ...outputs import SchedulerOutput

__all__ = ["BlockRefs", "INTROSPECTION_METHOD", "HashedBlock", "block_refs", "hashed_blocks", "non_plain_data"]

INTROSPECTION_METHOD = "block_ids_by_request"

#: Per request id (``None``: no request), the block-id lists the metadata holds.
BlockRefs = dict[str | None, list[list[int]]]

_NOT_BLOCKS = ("token", "hash", "key", "len", "num", "count", "size", "offset", "index", "idx", "pos")
_PLAIN_SCALARS = (
    type(None), bool, int, float, str, bytes, bytearray, enum.Enum,
    datetime.datetime, datetime.date, datetime.time, datetime.timedelta, uuid.UUID, decimal.Decimal, msgspec.Raw,
)  # fmt: skip


def block_refs(
    metadata: object,
    *,
    requests: Collection[str],
    num_blocks: int,
    tokens: Mapping[str, Collection[int]] | None = None,
) -> BlockRefs:
    """The block ids ``metadata`` carries, per request (see the module docstring)."""
    refs: BlockRefs = {}
    method = getattr(metadata, INTROSPECTION_METHOD, None)
    if callable(method):
        for req_id, ids in dict(method()).items():
            lists = ids if ids and not isinstance(ids[0], int) else [ids]
            refs.setdefault(req_id, []).extend(list(map(int, group)) for group in lists)
        return refs
    _Walker(refs, set(requests), num_blocks, tokens or {}).walk(metadata, None, "", set())
    return refs


class _Walker:
    def __init__(
        self, refs: BlockRefs, requests: set[str], num_blocks: int, tokens: Mapping[str, Collection[int]]
    ) -> None:
        self.refs, self.requests, self.num_blocks, self.tokens = refs, requests, num_blocks, tokens

    def _owner(self, values: Sequence[object], owner: str | None) -> str | None:
        for v in values:
            if isinstance(v, str) and v in self.requests:
                return v
        return owner

    def _add(self, ids: Sequence[int], owner: str | None, name: str) -> None:
        if not ids or any(word in name.lower() for word in _NOT_BLOCKS):
            return
        if any(not 0 <= i < self.num_blocks for i in ids):
            return
        if owner is not None and all(i in self.tokens.get(owner, ()) for i in ids):
            return
        self.refs.setdefault(owner, []).append(list(ids))

    def walk(self, obj: object, owner: str | None, name: str, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        if isinstance(obj, msgspec.Struct):
            seen = seen | {id(obj)}
            fields = [(f, getattr(obj, f)) for f in obj.__struct_fields__]
            owner = self._owner([v for _, v in fields], owner)
            for field_name, value in fields:
                if isinstance(value, int) and not isinstance(value, bool):
                    if "block" in field_name.lower():
                        self._add([value], owner, field_name.lower().replace("block", ""))
                    continue
                self.walk(value, owner, field_name, seen)
        elif isinstance(obj, Mapping):
            seen = seen | {id(obj)}
            inner = self._owner(list(obj.values()), owner)
            for key, value in obj.items():
                key_owner = key if isinstance(key, str) and key in self.requests else inner
                self.walk(value, key_owner, key if isinstance(key, str) and key not in self.requests else name, seen)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
            if items and all(isinstance(i, int) and not isinstance(i, bool) for i in items):
                self._add(items, owner, name)
                return
            seen = seen | {id(obj)}
            for item in items:
                self.walk(item, owner, name, seen)


class HashedBlock(NamedTuple):
    """A Struct of the metadata pairing a request's block id with a block hash; ``path`` is where it sits
    (``metadata.loads[2]``): its field names say whether it is a load or a save."""

    req_id: str
    block_id: int
    block_hash: bytes
    path: str


def hashed_blocks(metadata: object, requests: Collection[str], *, named: bool = True) -> list[HashedBlock]:
    """Each Struct in ``metadata`` that pairs a block id with a hash.

    A Struct pairs them when it names a request (a string field equal to its
    id), has exactly one int field named for a block id and exactly one
    ``bytes`` field: a transfer of that block, keyed by that hash. With
    ``named=False`` a Struct naming no request counts too (``req_id`` empty).
    """
    found: list[HashedBlock] = []
    _find_hashed(metadata, set(requests), found, set(), "metadata", named)
    return found


def _find_hashed(
    obj: object, requests: set[str], found: list[HashedBlock], seen: set[int], path: str, named: bool
) -> None:
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None))):
        return
    seen.add(id(obj))
    if isinstance(obj, msgspec.Struct):
        fields = [(f, getattr(obj, f)) for f in obj.__struct_fields__]
        owner = [v for _, v in fields if isinstance(v, str) and v in requests]
        ids = [
            v
            for f, v in fields
            if isinstance(v, int) and not isinstance(v, bool) and "block" in f and not any(w in f for w in _NOT_BLOCKS)
        ]
        hashes = [v for _, v in fields if isinstance(v, bytes)]
        if (len(owner) == 1 or not (named or owner)) and len(ids) == 1 and len(hashes) == 1:
            found.append(HashedBlock(owner[0] if owner else "", ids[0], hashes[0], path))
        values: list[tuple[str, object]] = [(f"{path}.{f}", v) for f, v in fields]
    elif isinstance(obj, Mapping):
        values = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        values = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        return
    for where, value in values:
        _find_hashed(value, requests, found, seen, where, named)


def non_plain_data(metadata: object) -> list[str]:
    """Where ``metadata`` holds something that is not plain data, e.g. ``"metadata.resolver: a callable"``.

    Plain data is what a worker in another process can receive: scalars,
    strings, bytes, containers of them, and msgspec Structs of them. Anything
    else (a callable, the block state, a request, the scheduler output, an
    engine object) either reaches back into the scheduler or is not data.
    """
    found: list[str] = []
    _find_non_plain(metadata, "metadata", found, set())
    return found


def _describe(obj: object) -> str:
    if isinstance(obj, KVConnectorBlockState):
        return "the KVConnectorBlockState (it holds a resolver bound to the KV cache manager)"
    if callable(obj):
        return f"a callable ({getattr(obj, '__qualname__', type(obj).__qualname__)})"
    cls = type(obj)
    return f"a {cls.__module__}.{cls.__qualname__}"


def _find_non_plain(obj: object, path: str, found: list[str], seen: set[int]) -> None:
    if isinstance(obj, _PLAIN_SCALARS):
        return
    if id(obj) in seen:
        found.append(f"{path}: a reference cycle")
        return
    seen = seen | {id(obj)}
    if isinstance(obj, SchedulerOutput):
        found.append(f"{path}: the SchedulerOutput (it reaches every request and every connector's metadata)")
    elif isinstance(obj, msgspec.Struct) and not callable(obj):
        for f in obj.__struct_fields__:
            _find_non_plain(getattr(obj, f), f"{path}.{f}", found, seen)
    elif isinstance(obj, Mapping) and not callable(obj):
        for key, value in obj.items():
            _find_non_plain(key, f"{path} key {key!r}", found, seen)
            _find_non_plain(value, f"{path}[{key!r}]", found, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, item in enumerate(obj):
            _find_non_plain(item, f"{path}[{i}]", found, seen)
    else:
        found.append(f"{path}: {_describe(obj)}")
