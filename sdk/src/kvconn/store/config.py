"""``StoreConfig``: the options every store connector has; a store's ``Config`` subclasses it."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["LoadAsync", "MaxBackoff", "SaveAsync", "SaveDecode", "StoreConfig"]

#: Upper bound of the durations, in seconds (a longer wait is a typo).
MAX_SECONDS = 3600.0

# The types of the options a store's Config may give another default (``load_async: LoadAsync = False``).
LoadAsync = Annotated[bool, msgspec.Meta(description="load on a worker thread while the engine runs other requests")]
SaveAsync = Annotated[
    bool,
    msgspec.Meta(
        description="put a step's saves on a worker thread while the engine computes the next step (copied into "
        "staging first; other engines sharing the store see them once the put returns)"
    ),
]
SaveDecode = Annotated[bool, msgspec.Meta(description="save blocks filled during decode too (not only the prompt's)")]
MaxBackoff = Annotated[
    float,
    msgspec.Meta(description="longest wait between probes (doubling from retry_interval_s)", gt=0, le=MAX_SECONDS),
]


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What :class:`~kvconn.store.StoreConnector` needs beyond the store; add the store's own fields in a subclass."""

    namespace: Annotated[
        str, msgspec.Meta(description="a namespace of its own within the engine's (runs that must not share blocks)")
    ] = ""
    load_async: LoadAsync = True
    timeout_s: Annotated[
        float,
        msgspec.Meta(
            description="deadline of one store call; past it the step degrades and the store is off until a probe "
            "answers",
            gt=0,
            le=MAX_SECONDS,
        ),
    ] = 2.0
    retry_interval_s: Annotated[
        float, msgspec.Meta(description="first wait before probing a store that is off", gt=0, le=MAX_SECONDS)
    ] = 1.0
    max_backoff_s: MaxBackoff = 30.0
    failed_block_cooldown_steps: Annotated[
        int,
        msgspec.Meta(
            description="steps during which a block whose load failed is not offered again (an engine re-asks at "
            "once after a failed load)",
            ge=1,
        ),
    ] = 1000
    save_decode: SaveDecode = True
    save_async: SaveAsync = False
    integrity_secret: (
        Annotated[
            str,
            msgspec.Meta(
                description="shared secret (>= 16 characters) of the engines sharing the store: values carry a keyed "
                "MAC and values without a valid one never load; unset: an unkeyed checksum",
                min_length=16,
            ),
        ]
        | None
    ) = None
