"""kvconn_sglang where SGLang is not installed (the main venv): it imports, checks specs, and says what is missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvconn_sglang
from kvconn_sglang import StorageSpec, StoreSpecError
from kvconn_sglang.spec import load_store_class

NO_SGLANG = importlib.util.find_spec("sglang") is None


def test_extra_config_is_what_sglangs_dynamic_backend_reads() -> None:
    config = kvconn_sglang.extra_config("redis", {"url": "redis://127.0.0.1:1/0"})
    assert config["module_path"] == "kvconn_sglang" and config["class_name"] == "KVConnStorage"
    assert config["interface_v1"] == 1 and config["backend_name"] == "kvconn"
    assert StorageSpec.from_extra_config(config) == StorageSpec("redis", {"url": "redis://127.0.0.1:1/0"})


@pytest.mark.parametrize("extra", [None, {}, {"kvconn_store": ""}, {"kvconn_store": "redis", "kvconn_config": [1]}])
def test_a_spec_without_a_store_or_with_a_bad_config_is_refused(extra: dict | None) -> None:
    with pytest.raises(StoreSpecError):
        StorageSpec.from_extra_config(extra)


def test_only_store_connectors_can_be_the_tier() -> None:
    assert load_store_class("redis").__name__ == "RedisConnector"
    with pytest.raises(StoreSpecError, match="not a kvconn store connector"):
        load_store_class("offload")


@pytest.mark.skipif(not NO_SGLANG, reason="SGLang is installed here")
def test_validate_engine_sglang_says_sglang_is_missing() -> None:
    kvconn = Path(sys.executable).parent / "kvconn"
    result = subprocess.run(
        [str(kvconn), "validate", "--engine", "sglang", "mooncake", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    (report,) = json.loads(result.stdout)["connectors"]
    assert "needs SGLang installed" in report["load_error"]
