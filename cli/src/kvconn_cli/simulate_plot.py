"""``kvconn simulate --plot``: tokens computed vs loaded over the run, and the connector hit rate.

matplotlib is an optional dependency (extra ``plot`` of kvconn-cli) and is
imported only here, when a plot is asked for.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

from kvconn._install import install_extra
from kvconn.reference.simulate import RunResult, Simulation, describe_local_cache

from .errors import UsageError

__all__ = ["plot_simulation", "require_matplotlib"]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend; :class:`UsageError` with the install line if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        install = install_extra("kvconn-cli", "plot", "cli")
        raise UsageError(f"--plot needs matplotlib, which is not installed here: {install}") from None
    return plt


def _cumulative(run: RunResult) -> tuple[list[int], list[int], list[int], list[float]]:
    """Steps, cumulative prompt tokens computed and loaded, and the running hit rate."""
    steps = [s.step + 1 for s in run.samples]
    computed = list(accumulate(s.prompt_tokens_computed for s in run.samples))
    loaded = list(accumulate(s.prompt_tokens_loaded for s in run.samples))
    seen = accumulate(s.prompt_tokens_computed + s.prompt_tokens_loaded + s.prompt_tokens_cached for s in run.samples)
    hit_rate = [100.0 * ld / n if n else 0.0 for ld, n in zip(loaded, seen, strict=True)]
    return steps, computed, loaded, hit_rate


def plot_simulation(result: Simulation, path: Path) -> None:
    """Write a two-panel PNG to ``path``; :class:`UsageError` if matplotlib is missing or the file unwritable."""
    plt = require_matplotlib()
    fig, (tokens_ax, rate_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 2))
    w = result.workload
    fig.suptitle(f"kvconn simulate: {w.name}, {w.description}\n{describe_local_cache(result.shape)}", fontsize=10)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate([result.baseline, *result.runs]):
        color = colors[i % len(colors)]
        steps, computed, loaded, hit_rate = _cumulative(run)
        tokens_ax.plot(steps, computed, color=color, label=f"{run.label}: computed")
        if run is not result.baseline:
            tokens_ax.plot(steps, loaded, color=color, linestyle="--", label=f"{run.label}: loaded")
            rate_ax.plot(steps, hit_rate, color=color, label=run.label)
    tokens_ax.set_ylabel("prompt tokens (cumulative)")
    tokens_ax.legend(fontsize=8, loc="upper left")
    tokens_ax.grid(alpha=0.3)
    rate_ax.set_ylabel("loaded / prompt tokens so far (%)")
    rate_ax.set_xlabel("engine step")
    rate_ax.set_ylim(0, 100)
    rate_ax.legend(fontsize=8, loc="lower right")
    rate_ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write --plot {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
