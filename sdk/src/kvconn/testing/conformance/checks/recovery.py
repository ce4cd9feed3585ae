"""Recovery: a load that fails every time ends, recomputed, instead of looping for ever.

The one-off failure of KV041 lets a connector forget what failed. A corrupt
value that stays in the store does not: every load of that block fails. An
engine that asks the connector again after a failed async load (vLLM 0.33's
``Scheduler._update_waiting_for_remote_kv``, and the reference scheduler,
which follows it) then livelocks on a connector that claims the block again.
"""

from __future__ import annotations

from ..catalog import check
from ..convergence import LIVELOCK_FIX
from ..driver import ScenarioUnsupported
from ..results import ConformanceFailure
from ..runs import PERSISTENT_FAILURE, PERSISTENT_FAILURE_TWO_GROUPS, data_run
from ..session import Session
from .data import UNTIDY_DATA_CHECK, compare_tokens


@check("KV046", "persistent-load-failure", fix=LIVELOCK_FIX, **UNTIDY_DATA_CHECK)
def persistent_load_failure(session: Session) -> None:
    """A block whose every load fails is recomputed, every request finishes, and the tokens are exact.

    ``a`` saves; then ``b`` and later ``b1`` share its first four blocks, and
    every load of the first of them lands garbage and is reported failed
    (``invalid_block_ids``), whichever request loads it. Catches connectors
    that keep claiming a block whose load failed: with async loads the engine
    re-asks them, they claim it again, and the request never finishes (the run
    stops after a few repeats, naming the request and the answer); with sync
    loads they fail every request sharing the block, which must still get
    exact tokens. Run again with two KV-cache groups, where vLLM re-asks after
    a failed sync load too (an engine that cannot run two groups with the
    connector leaves that run out).
    """
    for case in (PERSISTENT_FAILURE, PERSISTENT_FAILURE_TWO_GROUPS):
        try:
            result = data_run(session, case, fail_loads="persistent")
        except ScenarioUnsupported:
            continue
        if not result.driver.injected_failure:
            raise ConformanceFailure(
                f"in the {case.name!r} run the connector loaded nothing, so no load could be made to fail"
            )
        compare_tokens(session, case, result, " (every load of its first shared block failed)")
