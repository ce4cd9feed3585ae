"""Scheduler ↔ worker wire format: msgpack via msgspec.

``SchedulerOutput`` goes out with each connector's metadata encoded on its
own, so a worker decodes every connector's metadata into that connector's
``Metadata`` type and an error names the connector that caused it. The block
state is never on the wire; metadata holding it, a callable or anything else
that is not plain data is refused at encode time, with the fix in the message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from types import MappingProxyType
from typing import Any

import msgspec

from ..block_state import KVConnectorBlockState
from ..errors import BlockStateSerializationError, WireError
from ..metadata import KVConnectorMetadata
from ..outputs import ModelRunnerOutput, SchedulerOutput

__all__ = [
    "decode_metadata",
    "decode_model_runner_output",
    "decode_scheduler_output",
    "enc_hook",
    "encode_metadata",
    "encode_model_runner_output",
    "encode_scheduler_output",
]

_META_FIELD = "kv_connector_metadata"
_LOCAL_FIELDS = {"kv_connector_block_state"}
_FIELDS = [f for f in msgspec.structs.fields(SchedulerOutput) if f.name not in _LOCAL_FIELDS]


def _wire_field(f: msgspec.structs.FieldInfo) -> tuple[Any, ...]:
    typ = dict[str, msgspec.Raw] | None if f.name == _META_FIELD else f.type
    if f.default_factory is not msgspec.NODEFAULT:
        return (f.name, typ, msgspec.field(default_factory=f.default_factory))
    if f.default is not msgspec.NODEFAULT:
        return (f.name, typ, f.default)
    return (f.name, typ)


# The wire twin of SchedulerOutput: metadata stays raw until its connector's type is known.
_WireSchedulerOutput = msgspec.defstruct("_WireSchedulerOutput", [_wire_field(f) for f in _FIELDS])
_FIELD_NAMES = [f.name for f in _FIELDS]


def enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook``: read-only views of engine data go as lists and dicts; anything else is explained.

    Engines may hand connectors read-only views instead of lists (the vLLM
    adapter's ``ListView`` over vLLM's own lists, a ``MappingProxyType`` for
    ``num_scheduled_tokens``), so metadata that keeps one of them as it is
    encodes to what it shows, exactly as a list or dict would under the
    reference engine. Other mappings are not accepted: the block state's legacy
    ``block_ids`` view must never travel.
    """
    if isinstance(obj, KVConnectorBlockState):
        raise KVConnectorBlockState.serialization_error()
    if isinstance(obj, MappingProxyType):
        return dict(obj)
    if isinstance(obj, Sequence):  # str, bytes and lists never get here: msgspec encodes them itself
        return list(obj)
    what = getattr(obj, "__qualname__", type(obj).__qualname__)
    kind = "a callable" if callable(obj) else f"a {type(obj).__qualname__}"
    raise TypeError(
        f"metadata holds {kind} ({what}), which cannot be sent to workers: "
        "metadata must be plain data (ints, strings, lists, dicts, msgspec Structs); "
        "resolve what the worker needs (e.g. block ids via block_state.get_block_ids) into plain values"
    )


_encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_wire_decoder = msgspec.msgpack.Decoder(_WireSchedulerOutput)
_mro_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode_metadata(name: str, metadata: KVConnectorMetadata) -> bytes:
    """Encode one connector's metadata; errors name the connector."""
    try:
        return _encoder.encode(metadata)
    except BlockStateSerializationError as exc:
        raise BlockStateSerializationError(f"metadata of connector {name!r}: {exc}") from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"metadata of connector {name!r} cannot be encoded: {exc}", connector=name) from exc


def encode_scheduler_output(output: SchedulerOutput) -> bytes:
    """Encode a scheduler output (never its block state) to msgpack bytes."""
    values = {f: getattr(output, f) for f in _FIELD_NAMES}
    if output.kv_connector_metadata is not None:
        values[_META_FIELD] = {
            name: msgspec.Raw(encode_metadata(name, meta)) for name, meta in output.kv_connector_metadata.items()
        }
    return _encoder.encode(_WireSchedulerOutput(**values))


@cache
def _decoder_for(metadata_type: type[KVConnectorMetadata]) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(metadata_type)


def decode_scheduler_output(
    data: bytes, metadata_types: Mapping[str, type[KVConnectorMetadata]] | None = None
) -> SchedulerOutput:
    """Decode bytes from :func:`encode_scheduler_output`.

    ``metadata_types`` maps each connector this worker runs to its
    ``Metadata`` class; metadata for any other name is an error.
    """
    try:
        wire = _wire_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"scheduler output could not be decoded ({len(data)} bytes): {exc}") from exc
    values = {f: getattr(wire, f) for f in _FIELD_NAMES}
    raw: dict[str, msgspec.Raw] | None = values.pop(_META_FIELD)
    output = SchedulerOutput(**values)
    if raw is not None:
        types = metadata_types or {}
        output.kv_connector_metadata = {name: decode_metadata(name, blob, types) for name, blob in raw.items()}
    return output


def decode_metadata(
    name: str, blob: bytes | msgspec.Raw, types: Mapping[str, type[KVConnectorMetadata]]
) -> KVConnectorMetadata:
    """Decode one connector's metadata as its ``Metadata`` type from ``types``; errors name the connector."""
    meta_type = types.get(name)
    if meta_type is None:
        raise WireError(
            f"scheduler output carries metadata for connector {name!r}, which this worker does not run "
            f"(it runs: {', '.join(types) or 'none'}); scheduler and workers must load the same connectors",
            connector=name,
        )
    try:
        return _decoder_for(meta_type).decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(
            f"metadata of connector {name!r} could not be decoded as {meta_type.__name__}: {exc}", connector=name
        ) from exc


def encode_model_runner_output(output: ModelRunnerOutput) -> bytes:
    return _encoder.encode(output)


def decode_model_runner_output(data: bytes) -> ModelRunnerOutput:
    try:
        return _mro_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"model runner output could not be decoded ({len(data)} bytes): {exc}") from exc
