"""``--config`` / ``--config-file`` parsing: a JSON object, or a usage error that says what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconn_cli.config_input import read_config
from kvconn_cli.errors import EXIT_USAGE, UsageError


def test_no_config() -> None:
    assert read_config(None, None) is None


def test_inline_and_file(tmp_path: Path) -> None:
    assert read_config('{"a": 1, "b": [true]}', None) == {"a": 1, "b": [True]}
    path = tmp_path / "c.json"
    path.write_text('{"record_calls": false}')
    assert read_config(None, path) == {"record_calls": False}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", r"--config is not valid JSON \(Expecting property name"),
        ("[1, 2]", "must be a JSON object of config fields, got an array"),
        ('"x"', "got a string"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ],
)
def test_bad_inline_config(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=message) as info:
        read_config(text, None)
    assert info.value.exit_code == EXIT_USAGE


def test_both_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="exclusive"):
        read_config("{}", tmp_path / "c.json")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"cannot read --config-file .*missing\.json.*No such file"):
        read_config(None, tmp_path / "missing.json")
    with pytest.raises(UsageError, match="cannot read --config-file"):
        read_config(None, tmp_path)  # a directory
