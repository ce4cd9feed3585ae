"""The bad-input catalogue: one row per case, each a clear error of the documented type.

Rows with a CLI form are also run through the real ``kvconn`` executable: a
one-line message naming the problem, the documented exit code, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconn import (
    ConnectorConfigError,
    ConnectorContext,
    ConnectorLoadError,
    ConnectorNotFoundError,
    KVCacheGroupSpec,
    KVConnectorMetadata,
    WireError,
    load_connector,
)
from kvconn.host.wire import decode_model_runner_output, decode_scheduler_output, encode_scheduler_output
from kvconn.outputs import CachedRequestData, SchedulerOutput
from kvconn.reference import Engine, EngineShape
from kvconn_cli.config_input import read_config
from kvconn_cli.errors import UsageError

KVCONN = shutil.which("kvconn", path=str(Path(sys.executable).parent))


class Meta(KVConnectorMetadata):
    ids: list[int] = msgspec.field(default_factory=list)


class OtherMeta(KVConnectorMetadata):
    name: str


def wire_bytes(metadata: dict[str, KVConnectorMetadata] | None = None) -> bytes:
    return encode_scheduler_output(
        SchedulerOutput(1, [], CachedRequestData(), {}, 0, kv_connector_metadata=metadata or {"a": Meta(ids=[1])})
    )


class Case(NamedTuple):
    call: Callable[[], Any]
    error: type[Exception]
    message: str
    cli: list[str] | None = None  # the same mistake through the CLI
    #: the CLI's exit code: 2 for a usage error (a name or config the user typed), 1 for a connector that cannot load
    exit_code: int = 2


MEMORY = "kvconn.testing.memory_connector:MemoryConnector"

CATALOGUE: dict[str, Case] = {
    "config: wrong type": Case(
        lambda: load_connector(MEMORY, role="worker", config={"load_async": "sometimes"}),
        ConnectorConfigError,
        "field 'load_async': expected bool, got str",
        ["validate", "--module", MEMORY, "--config", '{"load_async": "sometimes"}'],
    ),
    "config: unknown key": Case(
        lambda: load_connector("dummy", role="worker", config={"colour": "red"}),
        ConnectorConfigError,
        "unknown field 'colour'; valid fields: record_calls",
        ["validate", "dummy", "--config", '{"colour": "red"}'],
    ),
    "config: not a mapping": Case(
        lambda: load_connector("dummy", role="worker", config=[1, 2]),  # type: ignore[arg-type]
        ConnectorConfigError,
        "must be a mapping",
    ),
    "config: invalid value": Case(
        lambda: load_connector(MEMORY, role="worker", config={"fail_hook": "no_such_hook"}),
        ConnectorConfigError,
        "fail_hook 'no_such_hook' is not a hook",
    ),
    "unknown connector name": Case(
        lambda: load_connector("dumy", role="worker"),
        ConnectorNotFoundError,
        "did you mean 'dummy'?",
        ["validate", "dumy"],
    ),
    "module path: no such module": Case(
        lambda: load_connector("no_such_pkg.mod:Thing", role="worker"),
        ConnectorLoadError,
        "failed to import module 'no_such_pkg.mod'",
        ["validate", "--module", "no_such_pkg.mod:Thing"],
        exit_code=1,
    ),
    "module path: not a connector": Case(
        lambda: load_connector("kvconn.host.wire:encode_scheduler_output", role="worker"),
        ConnectorLoadError,
        "not a connector class",
        ["validate", "--module", "kvconn.host.wire:encode_scheduler_output"],
        exit_code=1,
    ),
    "module path: malformed": Case(
        lambda: load_connector("kvconn:", role="worker"),
        ConnectorLoadError,
        "use the form 'package.module:ClassName'",
    ),
    "wire: truncated": Case(
        lambda: decode_scheduler_output(wire_bytes()[:-7], {"a": Meta}),
        WireError,
        "scheduler output could not be decoded",
    ),
    "wire: corrupt": Case(
        lambda: decode_scheduler_output(b"\xc1" * 32, {"a": Meta}),
        WireError,
        "could not be decoded",
    ),
    "wire: metadata from another connector": Case(
        lambda: decode_scheduler_output(wire_bytes({"a": OtherMeta(name="x")}), {"a": Meta}),
        WireError,
        "metadata of connector 'a' could not be decoded as Meta",
    ),
    "wire: metadata for a connector the worker does not run": Case(
        lambda: decode_scheduler_output(wire_bytes(), {"b": Meta}),
        WireError,
        "carries metadata for connector 'a', which this worker does not run",
    ),
    "offload config: pool_blocks out of range": Case(
        lambda: load_connector("offload", role="worker", config={"pool_blocks": 2**70}),
        ConnectorConfigError,
        "field 'pool_blocks': expected int <= 268435456",
        ["simulate", "--connector", "offload", "--config", json.dumps({"pool_blocks": 2**70})],
    ),
    "offload config: pool_bytes out of range": Case(
        lambda: load_connector("offload", role="worker", config={"pool_bytes": 2**64}),
        ConnectorConfigError,
        "field 'pool_bytes': expected int <= 70368744177664",
    ),
    "offload config: block_size_multiple out of range": Case(
        lambda: load_connector("offload", role="worker", config={"block_size_multiple": 2**40}),
        ConnectorConfigError,
        "field 'block_size_multiple': expected int <= 1024",
    ),
    "engine: a block pool too large to allocate": Case(
        lambda: Engine(num_blocks=2**63), ValueError, "num_blocks must be <= 4194304 in the reference engine"
    ),
    "engine: a request larger than the whole pool": Case(
        lambda: Engine(num_blocks=16).add_request([1] * 300, max_tokens=4),
        ValueError,
        "can never fit the KV cache",
    ),
    "engine: an integer KV dtype": Case(
        lambda: Engine(dtype="int8"),
        ValueError,
        "dtype must be one of float16, bfloat16, float32, float64 for the reference engine, got 'int8'",
    ),
    "engine: a dtype that does not exist": Case(
        lambda: Engine(dtype="bogus"), ValueError, "dtype must be one of float16, bfloat16, float32, float64"
    ),
    "engine: a sliding window of 0 tokens": Case(
        lambda: Engine(kv_cache_groups=(KVCacheGroupSpec(("layer.0",), sliding_window=0),)),
        ValueError,
        "KVCacheGroupSpec sliding_window must be >= 1 token (or None for full attention), got 0",
    ),
    "engine: a negative sliding window": Case(
        lambda: Engine(kv_cache_groups=[{"layer_names": ["layer.0"], "sliding_window": -5}]),
        ValueError,
        "sliding_window must be >= 1 token (or None for full attention), got -5",
    ),
    "engine: a KV-cache group with no layers": Case(
        lambda: Engine(kv_cache_groups=(KVCacheGroupSpec(()),)),
        ValueError,
        "KVCacheGroupSpec layer_names must name at least one layer, got none",
    ),
    "engine: a layer named twice": Case(
        lambda: Engine(kv_cache_groups=(KVCacheGroupSpec(("layer.0",)), KVCacheGroupSpec(("layer.0",), 32))),
        ValueError,
        "EngineShape kv_cache_groups: layer 'layer.0' is named twice (groups 0 and 1)",
    ),
    "engine: a layer named twice in one group": Case(
        lambda: EngineShape(kv_cache_groups=(KVCacheGroupSpec(("layer.0", "layer.0")),)),
        ValueError,
        "layer 'layer.0' is named twice (groups 0 and 0)",
    ),
    "engine: a negative token id": Case(
        lambda: Engine().add_request([5, -1, 7], max_tokens=4),
        ValueError,
        "prompt token ids must be integers in [0, 32000) (the reference model's vocabulary), got -1 at position 1",
    ),
    "engine: a token id past 2**63": Case(
        lambda: Engine().add_request([2**70], max_tokens=4),
        ValueError,
        f"prompt token ids must be integers in [0, 32000) (the reference model's vocabulary), got {2**70} at position",
    ),
    "context: block_size 0 (offload)": Case(
        lambda: load_connector("offload", role="worker", context=ConnectorContext(block_size=0)),
        ValueError,
        "ConnectorContext block_size must be >= 1, got 0",
    ),
    "context: block_size 0 (mooncake)": Case(
        lambda: load_connector("mooncake", role="scheduler", context=ConnectorContext(block_size=0)),
        ValueError,
        "ConnectorContext block_size must be >= 1, got 0",
    ),
    "context: a tensor-parallel rank outside the group": Case(
        lambda: ConnectorContext(tp_rank=2, tp_size=2),
        ValueError,
        "ConnectorContext tp_rank must be in [0, tp_size=2), got 2",
    ),
    "context: a layer named twice": Case(
        lambda: ConnectorContext(kv_cache_groups=(KVCacheGroupSpec(("a", "b")), KVCacheGroupSpec(("b",)))),
        ValueError,
        "ConnectorContext kv_cache_groups: layer 'b' is named twice (groups 0 and 1)",
    ),
    "config: nested too deeply": Case(
        lambda: read_config("[" * 100_000 + "]" * 100_000, None),
        UsageError,
        "nested too deeply",
        ["simulate", "--connector", "dummy", "--config", "[" * 20_000 + "]" * 20_000],
    ),
    "wire: model runner output": Case(
        lambda: decode_model_runner_output(b"\x92\x01"), WireError, "model runner output could not be decoded"
    ),
}


@pytest.mark.parametrize("case", CATALOGUE.values(), ids=CATALOGUE.keys())
def test_bad_input_gets_a_clear_error_of_the_documented_type(case: Case) -> None:
    with pytest.raises(case.error) as err:
        case.call()
    assert case.message in str(err.value)
    assert "\n" not in str(err.value)


CLI_CASES = {name: case for name, case in CATALOGUE.items() if case.cli}


@pytest.mark.skipif(KVCONN is None, reason="the kvconn CLI (kvconn-cli) is not installed")
@pytest.mark.parametrize("case", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_bad_input_in_the_cli_is_one_clear_line_without_traceback(case: Case) -> None:
    assert case.cli is not None and KVCONN is not None
    result = subprocess.run([KVCONN, *case.cli], capture_output=True, text=True, timeout=120)
    assert result.returncode == case.exit_code, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert case.message in result.stdout + result.stderr


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512))
def test_the_wire_decoder_never_fails_with_anything_but_a_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_scheduler_output(data, {"a": Meta})


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, 10_000), flip=st.integers(0, 255))
def test_mutated_real_messages_decode_or_fail_cleanly(cut: int, flip: int) -> None:
    data = bytearray(wire_bytes())
    data[cut % len(data)] ^= flip
    with contextlib.suppress(WireError):
        decode_scheduler_output(bytes(data), {"a": Meta})


@pytest.mark.parametrize(
    ("source", "what"),
    [("import sys\nsys.exit(0)\n", "called sys.exit(0)"), ("raise BaseException('boom')\n", "BaseException: boom")],
    ids=["sys.exit(0)", "BaseException"],
)
def test_a_plugin_exiting_or_raising_base_exception_at_import_is_a_load_error(
    source: str, what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bad_at_import.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for load in (
        lambda: load_connector("bad_at_import:Connector", role="worker"),
        lambda: Engine("bad_at_import:Connector"),
    ):
        with pytest.raises(ConnectorLoadError, match=r"'bad_at_import:Connector'.*") as err:
            load()
        assert what in str(err.value) and "\n" not in str(err.value)
        sys.modules.pop("bad_at_import", None)
