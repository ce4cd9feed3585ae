"""What a hook may answer: checks that turn a per-step hook's result into the host's types.

Each check returns the answer in the form the host uses (sets of ids, a
dict of stats, ``(num_tokens, load_async)``) or raises :class:`BadHookAnswer`
naming the value; the host handles that as if the hook had raised it, so a
bad answer degrades the connector for the step instead of reaching the
engine. The per-layer hooks return nothing and are not checked (they are
the hot path).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

__all__ = ["BadHookAnswer", "block_ids", "count", "finished", "id_set", "match", "stats"]


class BadHookAnswer(TypeError):
    """A hook returned something outside its contract; handled as if the hook had raised it."""


def finished(result: object) -> tuple[set[str], set[str]]:
    """``get_finished``'s answer: ``(finished_sending, finished_recving)``, each ``None`` or request ids."""
    if result is None:
        return set(), set()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise BadHookAnswer(f"returned {result!r}, not (finished_sending, finished_recving)")
    return id_set(result[0], "finished_sending", str), id_set(result[1], "finished_recving", str)


def block_ids(result: object) -> set[int]:
    """``get_block_ids_with_load_errors``'s answer: ``None`` or block ids."""
    return id_set(result, "block ids", int)


def count(result: object) -> int | None:
    """``get_num_tracked_requests``'s answer: ``None`` or an int >= 0."""
    if result is not None and (not isinstance(result, Integral) or isinstance(result, bool) or result < 0):
        raise BadHookAnswer(f"returned {result!r}, not an int >= 0 or None")
    return None if result is None else int(result)


def id_set(value: object, what: str, kind: type) -> set[Any]:
    """``value`` (``None`` or an iterable of ``kind``) as a set, or :class:`BadHookAnswer` naming ``what``."""
    if not value and isinstance(value, (set, frozenset, list, tuple, type(None))):
        return set()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BadHookAnswer(f"returned {what} {value!r}, not a set of {kind.__name__}")
    try:
        items = set(value)
    except TypeError as exc:
        raise BadHookAnswer(f"returned {what} that cannot be a set: {exc}") from None
    ok = Integral if kind is int else kind
    bad = next((v for v in items if not isinstance(v, ok) or isinstance(v, bool)), None)
    if bad is not None:
        raise BadHookAnswer(f"returned {what} holding {bad!r} ({type(bad).__name__}), not {kind.__name__}")
    return {int(v) for v in items} if kind is int else items


def stats(value: object) -> dict[str, float]:
    """``value`` (``None`` or a mapping of names to finite numbers) as a dict, or :class:`BadHookAnswer`."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadHookAnswer(f"returned {value!r}, not a mapping of stat names to numbers")
    for key, number in value.items():
        if not isinstance(key, str) or not isinstance(number, Real) or not math.isfinite(number):
            raise BadHookAnswer(f"returned stat {key!r}: {number!r}, not a name and a finite number")
    return dict(value)


def match(
    result: object, num_computed_tokens: int, num_request_tokens: int, block_size: int
) -> tuple[int | None, bool]:
    """``get_num_new_matched_tokens``'s answer as ``(num_tokens, load_async)``, or :class:`BadHookAnswer`.

    ``num_tokens`` must be an int >= 0 or ``None``, ``load_async`` a bool,
    and a hit must end on a block boundary unless it reaches the last
    token of the request's ``num_request_tokens`` (the engine then trims it
    to whole blocks): the engine loads whole blocks, so a hit ending inside
    one would leave that block's tail uncomputed.
    """
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise BadHookAnswer(f"returned {result!r}, not (num_tokens, load_async)")
    num_tokens, load_async = result
    if type(num_tokens) is not int and (  # the exact type first: the ABC check is slow, and this is per request
        num_tokens is not None and (not isinstance(num_tokens, Integral) or isinstance(num_tokens, bool))
    ):
        raise BadHookAnswer(f"returned num_tokens={num_tokens!r} ({type(num_tokens).__name__}), not an int or None")
    if type(load_async) is not bool and not isinstance(load_async, int):
        raise BadHookAnswer(f"returned load_async={load_async!r} ({type(load_async).__name__}), not a bool")
    if num_tokens is None:
        return None, False
    num_tokens = int(num_tokens)
    end = num_computed_tokens + num_tokens
    if num_tokens < 0 or (end % block_size and end < num_request_tokens - 1):
        raise BadHookAnswer(
            f"returned num_tokens={num_tokens} after {num_computed_tokens} computed tokens: a hit must be >= 0 "
            f"and end on a block boundary (block size {block_size}), the engine loads whole blocks"
        )
    return num_tokens, bool(load_async)
