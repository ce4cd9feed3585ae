"""The header every stored value starts with, and its check before a load lands.

Keys are predictable and puts are first-writer-wins, so whatever sits under a
key may have been written by anyone: another client, an engine of another KV
shape (a field the key namespace may not cover), a writer whose memory changed
under a timed-out put, or nobody (a short read). A value is therefore
``header + payload``, and a load is staged and verified before any byte of it
is copied into the KV cache. The 64-byte header holds:

* magic and version (a value not written by this connector fails here);
* the payload length;
* a digest of the key the value was written for (a value copied or written
  under another key fails);
* a digest of the group's KV layout: layer names, per-block shape and dtype
  (an engine of another shape with equal block bytes fails);
* a tag over all of the above and the payload: a 128-bit XXH3 hash by default
  (catches accidents: torn, short or foreign values; at tens of GB/s it costs
  little next to the copy), or, when the engines share an ``integrity_secret``,
  a keyed BLAKE2b MAC (catches a writer without the secret who forges a
  well-formed value).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Any

import xxhash

__all__ = ["HEADER_BYTES", "Integrity", "layout_digest", "secret_id"]

HEADER_BYTES = 64
_MAGIC = b"KVMC"
_VERSION = 2  # 2: XXH3-128 tags (1 had CRC32)
_FLAG_MAC = 1
_HEAD = struct.Struct("<4sBBHQ16s8s")  # magic, version, flags, reserved, payload length, key digest, layout digest
_TAG_BYTES = 16
_PAD = bytes(HEADER_BYTES - _HEAD.size - _TAG_BYTES)


def secret_id(secret: str | None) -> str:
    """A public name of ``secret`` (a keyed digest, so it reveals nothing of it); ``""`` without one."""
    if secret is None:
        return ""
    return hashlib.blake2b(b"kvconn-mooncake-namespace", key=secret.encode(), digest_size=16).hexdigest()


def layout_digest(layers: Sequence[tuple[str, tuple[int, ...], str]]) -> bytes:
    """8 bytes naming a group's per-block layout: ``(layer name, block shape, dtype)`` per layer."""
    return hashlib.sha256(repr(tuple(layers)).encode()).digest()[:8]


class Integrity:
    """Seals values on save and verifies them on load, with or without a shared secret."""

    def __init__(self, secret: str | None = None) -> None:
        self._key = secret.encode() if secret is not None else None
        self._flags = _FLAG_MAC if self._key is not None else 0

    def _tag(self, head: bytes, payload: Sequence[memoryview]) -> bytes:
        mac: Any = (
            xxhash.xxh3_128(head) if self._key is None else hashlib.blake2b(head, key=self._key, digest_size=_TAG_BYTES)
        )
        for part in payload:
            mac.update(part)
        return mac.digest()

    def seal(self, key: str, layout: bytes, parts: Sequence[memoryview]) -> bytes:
        """The header of the value ``key`` stores: the byte ``parts`` that follow it, in order."""
        length = sum(part.nbytes for part in parts)
        head = _HEAD.pack(_MAGIC, _VERSION, self._flags, 0, length, _key_digest(key), layout)
        return head + self._tag(head, parts) + _PAD

    def verify(self, key: str, layout: bytes, value: memoryview) -> str | None:
        """Why ``value`` (header and payload, as read under ``key``) must not be loaded; ``None`` if it may."""
        if len(value) < HEADER_BYTES:
            return "short"
        magic, version, flags, _, length, key_digest, value_layout = _HEAD.unpack_from(value)
        if magic != _MAGIC or version != _VERSION:
            return "foreign"
        if flags != self._flags:
            return "unsigned" if self._key is not None else "signed"
        if length != len(value) - HEADER_BYTES:
            return "short"
        if key_digest != _key_digest(key):
            return "other_key"
        if value_layout != layout:
            return "other_layout"
        tag = value[_HEAD.size : _HEAD.size + _TAG_BYTES]
        if not hmac.compare_digest(tag, self._tag(bytes(value[: _HEAD.size]), [value[HEADER_BYTES:]])):
            return "checksum"
        return None


def _key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]
