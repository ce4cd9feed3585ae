"""Reading a connector config from the command line (``--config JSON`` or ``--config-file FILE``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UsageError

__all__ = ["read_config"]

_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def read_config(config: str | None, config_file: Path | None) -> dict[str, Any] | None:
    """The config mapping the options give, or ``None`` when neither is set.

    Raises :class:`UsageError` when both are given, the file cannot be read,
    or the text is not a JSON object.
    """
    if config is not None and config_file is not None:
        raise UsageError("--config and --config-file are exclusive: pass the config one way")
    if config_file is not None:
        try:
            text = config_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UsageError(f"cannot read --config-file {str(config_file)!r}: {reason}") from None
        return _parse(text, f"--config-file {str(config_file)!r}")
    if config is not None:
        return _parse(config, "--config")
    return None


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{source} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "pass an object such as '{\"field\": 1}'"
        ) from None
    except RecursionError:
        raise UsageError(f"{source} is nested too deeply to read; a connector config is a flat JSON object") from None
    if not isinstance(value, dict):
        kind = _JSON_KINDS.get(type(value), type(value).__name__)
        raise UsageError(f"{source} must be a JSON object of config fields, got {kind}")
    return value
