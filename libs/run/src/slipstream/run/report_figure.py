"""A report's plot as data (`Plot`, its `Panel`s and their series) and as a matplotlib figure.

`slipstream report` (report.py) decides what to plot; this draws it so that nothing is cut: the
figure is laid out at the resolution it is saved at, grows with a bar chart's bars and their
labels, and re-wraps a title that would leave it. `figure` returns the Figure itself, so a test can
read the drawn artists (legend labels, titles, tick labels) against the data.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Series = dict[str, list[float]]


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    kind: str  # "line", "bar" or "barh"
    series: dict[str, Series]
    labels: list[str] = field(default_factory=list)
    """Tick labels of a "barh" panel, one per bar."""


@dataclass
class Plot:
    name: str
    title: str
    caption: str
    panels: list[Panel] = field(default_factory=list)


DPI = 110


def figure(plot: Plot) -> Any:
    """The plot as a matplotlib Figure (Agg, no display), laid out so no title or tick label is cut."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    bars = max((len(p.labels) for p in plot.panels if p.kind == "barh"), default=0)
    width = 6.5 * len(plot.panels) + (3.5 if bars else 0.0)  # room for a barh panel's stage names
    height = max(4.2, 1.6 + 0.32 * bars * max(1, max((len(p.series) for p in plot.panels), default=1)))
    # Laid out and checked at the resolution it is saved at: text widths do not scale exactly with dpi.
    fig, axes = plt.subplots(1, len(plot.panels), figsize=(width, height), dpi=DPI, squeeze=False)
    wrap = max(40, int(width * 72 / 7.5 / len(plot.panels)))  # characters of a 10 pt title per panel width
    for ax, panel in zip(axes[0], plot.panels, strict=True):
        for i, (label, s) in enumerate(panel.series.items()):
            if panel.kind == "bar":
                ax.bar(s["x"], s["y"], label=label)
                ax.set_xticks(s["x"])
            elif panel.kind == "barh":
                # Several series side by side per bar, each a slice of the row's 0.8 height.
                h = 0.8 / len(panel.series)
                ax.barh([x - 0.4 + h * (i + 0.5) for x in s["x"]], s["y"], height=h, label=label)
                if i == 0:
                    ax.set_yticks(s["x"], panel.labels, fontsize=7)
                    ax.invert_yaxis()
            else:
                ax.plot(s["x"], s["y"], marker="o" if len(s["x"]) < 40 else None, markersize=3, label=label)
        title = panel.title if len(plot.panels) > 1 else f"{plot.title}: {panel.title}"
        ax.set_title(textwrap.fill(title, wrap, break_on_hyphens=False), fontsize=10)
        if panel.kind == "line" and all(float(x).is_integer() for s in panel.series.values() for x in s["x"]):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions are whole numbers
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(fontsize=8)
    if len(plot.panels) > 1:
        fig.suptitle(plot.title)
    fig.tight_layout()
    # A title is centred over its axes, which long tick labels push aside: re-wrap it narrower until
    # it lies inside the figure (a few passes; layout moves the axes again each time).
    for _ in range(4):
        over = [ax for ax in axes[0] if not _within(ax.title.get_window_extent(), fig.bbox)]
        if not over:
            break
        wrap = max(20, int(wrap * 0.75))
        for ax in over:
            text = ax.title.get_text().replace("\n", " ")
            ax.set_title(textwrap.fill(text, wrap, break_on_hyphens=False), fontsize=10)
        fig.tight_layout()
    return fig


def _within(box: Any, edge: Any) -> bool:
    return bool(box.x0 >= edge.x0 and box.x1 <= edge.x1 and box.y0 >= edge.y0 and box.y1 <= edge.y1)


def save(fig: Any, path: Path, dpi: int = DPI) -> Path:
    """Write `fig` to `path` (its folder made if missing) and close it, so figures do not pile up."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def draw(plot: Plot, path: Path) -> None:
    save(figure(plot), path)
