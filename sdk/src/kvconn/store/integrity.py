"""The header every stored value starts with, checked before any byte reaches a KV cache.

Keys are predictable and puts are first-writer-wins, so whatever a key holds
may have been written by anyone: another program, an engine of another KV
shape, an older kvconn, or nobody (a torn or evicted-and-rewritten value). A
value is therefore ``header + payload``; the 64-byte header holds magic and
version, flags, the payload length, a digest of the key the value was written
for, a digest of the block layout (layer names, block shape, dtype), and a
16-byte tag over all of it and the payload: a keyed BLAKE2b MAC when the
engines share a secret (then a writer without it cannot forge a value that
loads), else an XXH3-128 checksum (catches accidents: torn, short or foreign
values, at tens of GB/s, so it costs little next to moving the bytes).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

__all__ = ["HEADER_BYTES", "Integrity", "layout_digest", "secret_id"]

HEADER_BYTES = 64
_MAGIC = b"KVST"
_VERSION = 1
_FLAG_MAC = 1
_HEAD = struct.Struct("<4sBBHQ16s8s")  # magic, version, flags, reserved, payload length, key digest, layout digest
_TAG = 16
_PAD = bytes(HEADER_BYTES - _HEAD.size - _TAG)


def secret_id(secret: str | None) -> str:
    """A public name of ``secret`` (a keyed digest, revealing nothing of it); ``""`` without one."""
    if secret is None:
        return ""
    return hashlib.blake2b(b"kvconn-store-namespace", key=secret.encode(), digest_size=16).hexdigest()


def layout_digest(layers: Sequence[tuple[str, tuple[int, ...], str]]) -> bytes:
    """8 bytes naming a value's layout: ``(layer name, block shape, dtype)`` per layer, in order."""
    return hashlib.sha256(repr(tuple(layers)).encode()).digest()[:8]


class Integrity:
    """Seals values on save and verifies them on load."""

    def __init__(self, secret: str | None = None) -> None:
        self._flags = _FLAG_MAC if secret is not None else 0
        #: a running tag started over a head: chosen once, not per value (on the path of every page and block)
        self._mac: Callable[[bytes], Any] = xxhash.xxh3_128
        if secret is not None:
            self._mac = functools.partial(hashlib.blake2b, key=secret.encode(), digest_size=_TAG)

    def _tag(self, head: bytes, payload: Sequence[memoryview]) -> bytes:
        mac = self._mac(head)
        for part in payload:
            mac.update(part)
        return mac.digest()

    def seal(
        self, key: bytes, layout: bytes, payload: memoryview | Sequence[memoryview], payload_bytes: int | None = None
    ) -> bytes:
        """The header of the value ``key`` stores, ``payload`` (one view, or parts in order) following it.

        ``payload_bytes``: the payload's total size when the caller knows it (saves summing the parts); a
        wrong one seals a value that never verifies.
        """
        parts = [payload] if isinstance(payload, memoryview) else payload
        if payload_bytes is None:
            payload_bytes = sum([part.nbytes for part in parts])
        head = _head(self._flags, payload_bytes, key, layout)
        return head + self._tag(head, parts) + _PAD

    def verify(self, key: bytes, layout: bytes, value: memoryview) -> str | None:
        """Why ``value`` (header and payload, read under ``key``) must not be loaded; ``None`` if it may."""
        if value.nbytes < HEADER_BYTES:
            return "short"
        return self.verify_parts(key, layout, value[:HEADER_BYTES], [value[HEADER_BYTES:]])

    def verify_parts(
        self,
        key: bytes,
        layout: bytes,
        header: memoryview,
        payload: Sequence[memoryview],
        payload_bytes: int | None = None,
    ) -> str | None:
        """As :meth:`verify`, for a value read as its ``HEADER_BYTES`` header and its payload in parts, in order.

        A value sealed for this key, layout and length starts with the very head :meth:`seal` wrote: one
        comparison with it settles every field; only a value that differs is taken apart to say why.
        ``payload_bytes``: the parts' total size when the caller knows it (as for :meth:`seal`).
        """
        if payload_bytes is None:
            payload_bytes = sum([part.nbytes for part in payload])
        head = _head(self._flags, payload_bytes, key, layout)
        if header[: _HEAD.size] != head:
            return self._mismatch(head, header)
        tag = self._tag(head, payload)
        return None if hmac.compare_digest(header[_HEAD.size : _HEAD.size + _TAG], tag) else "checksum"

    @staticmethod
    def _mismatch(expected: bytes, header: memoryview) -> str:
        """Why a head differs from the one expected: the first field, in order, that does."""
        magic, version, flags, _, length, key_digest, layout = _HEAD.unpack_from(header)
        want = _HEAD.unpack(expected)
        if (magic, version) != want[:2]:
            return "foreign"
        if flags != want[2]:
            return "unsigned" if want[2] else "signed"
        if length != want[4]:
            return "short"
        if key_digest != want[5]:
            return "other_key"
        return "other_layout" if layout != want[6] else "foreign"  # else a reserved field kvconn never sets


@functools.lru_cache(maxsize=4096)  # a hit prefix's keys are sealed once and verified on every load
def _head(flags: int, length: int, key: bytes, layout: bytes) -> bytes:
    """The head of a value sealed for ``key`` (its tag follows): the same bytes for every value of that key."""
    return _HEAD.pack(_MAGIC, _VERSION, flags, 0, length, hashlib.sha256(key).digest()[:16], layout)
