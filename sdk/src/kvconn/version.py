"""Versions: of the distribution, and of the hook API plugins declare."""

from __future__ import annotations

__all__ = ["API_VERSION", "check_api_version"]

#: The hook API this SDK implements. A plugin declaring ``MAJOR.MINOR`` loads
#: when MAJOR is equal and MINOR is not newer than ours.
API_VERSION = "1.0"


def check_api_version(declared: object) -> str | None:
    """Why a plugin declaring ``declared`` cannot load, or ``None`` if it can."""
    ours = tuple(int(p) for p in API_VERSION.split("."))
    try:
        major, minor = (int(p) for p in str(declared).split("."))
    except ValueError:
        return f"api_version {declared!r} is not of the form 'MAJOR.MINOR' (this SDK implements {API_VERSION})"
    if major != ours[0]:
        return f"it targets hook API {declared}, this SDK implements {API_VERSION}: a different major version"
    if minor > ours[1]:
        return f"it targets hook API {declared}, newer than this SDK's {API_VERSION}: upgrade kvconn-sdk"
    return None
