"""``kvconn simulate --plot``: every run is drawn, and can be told apart, even when two runs have equal figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.lines import Line2D

from kvconn.reference.simulate import SIMULATE_SHAPE
from kvconn.reference.workloads import make_workload
from kvconn_cli.commands.simulate import setups_from_options
from kvconn_cli.measure import Simulation, simulate
from kvconn_cli.simulate_plot import draw_simulation, plot_simulation


@pytest.fixture(scope="module")
def two_equal_runs() -> Simulation:
    """offload twice, on an engine without a prefix cache (so offload loads): two runs with equal figures."""
    setups = setups_from_options(["offload", "offload"], None)
    shape = SIMULATE_SHAPE.replace(enable_prefix_caching=False)
    result = simulate(make_workload("shared-prefix", 6), setups, shape, repeats=1, min_round_s=0)
    first, second = result.runs
    assert [s.prompt_tokens_loaded for s in first.samples] == [s.prompt_tokens_loaded for s in second.samples]
    assert first.stats.prompt_tokens_loaded > 0
    return result


def _marked_points(line: Line2D) -> set[tuple[float, float]]:
    """The (step, value) points where ``line`` draws its markers."""
    start, stride = line.get_markevery()
    xs, ys = line.get_xdata(), line.get_ydata()
    return {(float(x), float(y)) for x, y in list(zip(xs, ys, strict=True))[start::stride]}


def test_two_runs_with_equal_figures_are_both_drawn(two_equal_runs: Simulation) -> None:
    import matplotlib.pyplot as plt

    fig = draw_simulation(two_equal_runs)
    try:
        tokens_ax, rate_ax = fig.axes[:2]
        for ax, suffix in ((tokens_ax, ": loaded"), (rate_ax, "")):
            lines = [ln for ln in ax.get_lines() if ln.get_label().endswith(suffix) and ln.get_visible()]
            runs = [ln for ln in lines if ln.get_label().split(":")[0] in {r.label for r in two_equal_runs.runs}]
            assert len(runs) == 2, [ln.get_label() for ln in ax.get_lines()]
            a, b = runs
            assert list(a.get_ydata()) == list(b.get_ydata())  # the same data ...
            assert (a.get_marker(), a.get_linestyle()) != (b.get_marker(), b.get_linestyle())  # ... drawn apart
            assert _marked_points(a) and _marked_points(b) and not _marked_points(a) & _marked_points(b)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in (tokens_ax, rate_ax):
            legend = ax.get_legend()
            assert legend is not None
            # outside the data: the legend's box does not overlap the panel's
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    finally:
        plt.close(fig)


def test_the_png_keeps_the_legends(two_equal_runs: Simulation, tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "plot.png"
    plot_simulation(two_equal_runs, path)
    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 1.4 * height  # the panels plus a legend column right of them (bbox "tight" kept it)
