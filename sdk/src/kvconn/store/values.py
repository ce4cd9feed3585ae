"""A stored value as parts: sealing one from views of engine memory, and judging one read back.

Engine-neutral: a value is the integrity header followed by its payload, and
the payload is any sequence of byte views (a vLLM block's row in each layer,
an SGLang host page's K and V buffers). The worker side of
:class:`~kvconn.store.StoreConnector` and the SGLang storage tier
(``kvconn_sglang``) both seal and judge values here, so that what one engine
writes the other's rules read, and neither copies the other's code.
"""

from __future__ import annotations

from collections.abc import Sequence

from .integrity import HEADER_BYTES, Integrity

__all__ = ["explain", "judge", "seal_parts"]


def seal_parts(
    integrity: Integrity,
    keys: Sequence[bytes],
    digest: bytes,
    payloads: Sequence[Sequence[memoryview]],
    payload_bytes: int | None = None,
) -> list[list[memoryview]]:
    """Per key, the parts of its value: a fresh header sealed over ``payloads[i]``, then those views.

    The headers live in memory of their own (a put past its deadline may still
    read them); the tags are taken now, so a payload that changes before a late
    put reads it stores a value that fails :func:`judge`. ``payload_bytes``:
    every payload's total size, when they share one (a page, a block).
    """
    headers = memoryview(bytearray(len(keys) * HEADER_BYTES))
    parts: list[list[memoryview]] = []
    at = 0
    for key, payload in zip(keys, payloads, strict=True):
        header = headers[at : at + HEADER_BYTES]
        header[:] = integrity.seal(key, digest, payload, payload_bytes)
        parts.append([header, *payload])
        at += HEADER_BYTES
    return parts


def judge(
    integrity: Integrity,
    key: bytes,
    digest: bytes,
    length: int | None,
    header: memoryview,
    payload: Sequence[memoryview],
    payload_bytes: int | None = None,
) -> str | None:
    """Why the value read under ``key`` (``length`` bytes, ``None``: missing) must not be used; ``None`` if it may.

    ``"missing"``, or ``"integrity_<reason>"`` (see :meth:`Integrity.verify_parts`). ``payload_bytes``: the
    payload's total size when the caller knows it (a page, a block: on the path of every one loaded).
    """
    if length is None:
        return "missing"
    if payload_bytes is None:
        payload_bytes = sum([part.nbytes for part in payload])
    if length != HEADER_BYTES + payload_bytes:
        return "integrity_short"
    reason = integrity.verify_parts(key, digest, header, payload, payload_bytes)
    return None if reason is None else f"integrity_{reason}"


def explain(verdict: str, *, unit: str, layout: str, lands_in: str, instead: str) -> str:
    """The operator's line for a load that failed with ``verdict`` (see :func:`judge`).

    ``unit`` is what a value holds (a block, a page), ``layout`` what its header names, ``lands_in`` where
    verified bytes go and ``instead`` what the engine does when they do not.
    """
    if verdict == "missing":
        return f"a {unit} was gone when loaded (evicted, or the store restarted); {instead}"
    return (
        f"a stored value failed verification ({verdict.removeprefix('integrity_')}): not written by this connector "
        f"for this key and {layout}, or damaged; it never reaches {lands_in} and {instead}"
    )
