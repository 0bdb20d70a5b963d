"""A PNG Gantt chart of a simulated step, drawn with matplotlib (an optional dependency).

The legend lives in an axes of its own under the chart, laid out by matplotlib's constrained
layout with the chart's ticks and axis label, so it never covers them; the title wraps to
the figure's width."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipecc.render.boxes import (
    FUSED_NOTE,
    boxes,
    colour,
    ink,
    legend,
    messages,
    num_chunks,
    title,
    wrap,
)
from pipecc.simulate.timeline import Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

TITLE_POINTS = 10
KEY_COLUMN_INCHES = 0.75  # one legend entry's width


class MissingDependencyError(RuntimeError):
    """An optional package a renderer needs is not installed."""


def render_png(timeline: Timeline, path: str, *, arrows: bool = False) -> None:
    """The same chart as the SVG, drawn with matplotlib (an optional dependency)."""
    figure = draw_figure(timeline, arrows=arrows)
    from matplotlib import pyplot  # noqa: PLC0415  (imported by draw_figure already)

    figure.savefig(path, dpi=150)
    pyplot.close(figure)


def draw_figure(timeline: Timeline, *, arrows: bool = False) -> Figure:
    """The chart as a matplotlib figure: the Gantt axes on top, the legend's axes below."""
    try:
        import matplotlib  # noqa: PLC0415  (optional, heavy)

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
    except ImportError as err:
        raise MissingDependencyError(
            "PNG output needs matplotlib (pip install matplotlib); --svg needs nothing"
        ) from err
    ranks = timeline.program.num_ranks
    drawn = boxes(timeline)
    chunks = num_chunks(timeline)
    entries = legend(drawn, chunks)
    fused = any(box.band for box in drawn)
    width = min(24.0, max(6.0, 4 + timeline.makespan / 4))
    columns = max(1, min(len(entries), int(width / KEY_COLUMN_INCHES)))
    key_rows = math.ceil(len(entries) / columns) + fused
    heading = wrap(title(timeline), _title_columns(width * 72))
    chart_height = 0.6 + ranks * 0.45
    key_height = 0.25 * key_rows + 0.1
    figure, (axes, key) = pyplot.subplots(
        2,
        1,
        figsize=(width, chart_height + key_height + 0.2 * len(heading) + 0.3),
        gridspec_kw={"height_ratios": (chart_height, key_height)},
        layout="constrained",
    )
    _draw_boxes(axes, timeline, chunks)
    if arrows:
        for src, sent, dst, arrived, _ in messages(timeline):
            axes.annotate(
                "",
                xy=(arrived, dst),
                xytext=(sent, src),
                arrowprops={"arrowstyle": "->", "lw": 0.4, "alpha": 0.5},
            )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_xlabel(f"time ({timeline.costs.unit or 'units'})")
    _fit_title(figure, title(timeline))
    _draw_legend(key, entries, columns, fused=fused)
    return figure


def _title_columns(points: float) -> int:
    """About how many title characters fit in `points` (a character is ~0.62 em wide)."""
    return int(points / (TITLE_POINTS * 0.62))


def _fit_title(figure: Figure, text: str) -> None:
    """The title over the whole figure, wrapped until it fits the figure's width as drawn."""
    columns = _title_columns(figure.bbox.width * 72 / figure.dpi)
    for _ in range(4):
        artist = figure.suptitle("\n".join(wrap(text, columns)), fontsize=TITLE_POINTS)
        drawn = artist.get_window_extent()
        if drawn.width <= figure.bbox.width * 0.98:
            return
        columns = int(columns * figure.bbox.width * 0.95 / drawn.width)


def _draw_boxes(axes: Axes, timeline: Timeline, chunks: int) -> None:
    """The boxes, one bar collection per row, band and colour (one per box is slow at P=8),
    and each box's microbatch where it fits."""
    bars: dict[tuple[float, float, str], list[tuple[float, float]]] = {}
    for box in boxes(timeline):
        height, bottom = (
            (0.8, box.rank - 0.4) if not box.band else (0.4, box.rank - 0.4 + (box.band - 1) * 0.4)
        )
        fill = colour(box, chunks)
        bars.setdefault((bottom, height, fill), []).append((box.start, box.end - box.start))
        if box.end - box.start >= timeline.makespan / 80:
            axes.text(
                (box.start + box.end) / 2,
                bottom + height / 2,
                str(box.mb),
                ha="center",
                va="center",
                fontsize=7,
                color=ink(fill),
            )
    for (bottom, height, fill), spans in bars.items():
        axes.broken_barh(spans, (bottom, height), facecolors=fill, edgecolor="white", linewidth=0.5)


def _draw_legend(key: Axes, entries: list[tuple[str, str]], columns: int, *, fused: bool) -> None:
    """The legend fills the axes `key`, which shows nothing else."""
    from matplotlib.patches import Patch  # noqa: PLC0415  (optional, heavy)

    key.set_axis_off()
    handles = [Patch(color=fill, label=label) for label, fill in entries]
    key.legend(
        handles=handles,
        ncol=columns,
        fontsize=8,
        loc="upper center",
        frameon=False,
        title=FUSED_NOTE if fused else None,
        title_fontsize=7,
    )
