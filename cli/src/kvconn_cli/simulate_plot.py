"""``kvconn simulate --plot``: tokens computed vs loaded over the run, and the connector hit rate.

matplotlib is an optional dependency (extra ``plot`` of kvconn-cli) and is
imported only here, when a plot is asked for.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path
from typing import Any

from kvconn.install import install_extra
from kvconn.reference.simulate import RunResult

from .errors import UsageError
from .measure import Simulation, describe_local_cache

__all__ = ["draw_simulation", "plot_simulation", "require_matplotlib"]


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


#: One per run, in order (the baseline first): runs with identical figures still show as separate lines.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
#: About this many markers per line; each run's start at a different step, so equal lines show every run's.
_MARKS_PER_LINE = 12


def draw_simulation(result: Simulation) -> Any:
    """The two-panel figure of ``result`` (a ``matplotlib.figure.Figure``): the caller saves and closes it.

    Every run has its own color, marker and line style, and its markers sit at
    steps offset from the other runs', so two runs with the same figures are
    both visible. In the token panel a run's computed line has filled markers
    and its loaded line hollow ones. The legends sit right of the panels,
    outside the data.
    """
    plt = require_matplotlib()
    fig, (tokens_ax, rate_ax) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, height_ratios=(3, 2))
    w = result.workload
    fig.suptitle(f"kvconn simulate: {w.name}, {w.description}\n{describe_local_cache(result.shape)}", fontsize=10)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    runs = [result.baseline, *result.runs]
    for i, run in enumerate(runs):
        steps, computed, loaded, hit_rate = _cumulative(run)
        stride = max(len(runs), len(steps) // _MARKS_PER_LINE)  # >= one step per run: distinct offsets
        style = {
            "color": colors[i % len(colors)],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "markevery": (i * stride // len(runs), stride),
            "markersize": 5,
        }
        tokens_ax.plot(steps, computed, label=f"{run.label}: computed", **style)
        if run is not result.baseline:
            tokens_ax.plot(steps, loaded, label=f"{run.label}: loaded", markerfacecolor="none", **style)
            rate_ax.plot(steps, hit_rate, label=run.label, **style)
    tokens_ax.set_ylabel("prompt tokens (cumulative)")
    rate_ax.set_ylabel("loaded / prompt tokens so far (%)")
    rate_ax.set_xlabel("engine step")
    rate_ax.set_ylim(0, 100)
    for ax in (tokens_ax, rate_ax):
        if ax.lines:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_simulation(result: Simulation, path: Path) -> None:
    """Write :func:`draw_simulation`'s figure to ``path`` as a PNG; :class:`UsageError` if that cannot be done."""
    plt = require_matplotlib()
    fig = draw_simulation(result)
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legends outside the panels are kept
    except OSError as exc:
        raise UsageError(f"cannot write --plot {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
