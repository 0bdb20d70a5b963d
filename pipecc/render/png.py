"""A PNG Gantt chart of a simulated step, drawn with matplotlib (an optional dependency)."""

from __future__ import annotations

from pipecc.ir.ops import Kind
from pipecc.render.boxes import COLOURS, boxes, colour, messages
from pipecc.simulate.timeline import Timeline


class MissingDependencyError(RuntimeError):
    """An optional package a renderer needs is not installed."""


def render_png(timeline: Timeline, path: str, *, arrows: bool = False) -> None:
    """The same chart as the SVG, drawn with matplotlib (an optional dependency)."""
    try:
        import matplotlib  # noqa: PLC0415  (optional, heavy)

        matplotlib.use("Agg")
        from matplotlib import pyplot  # noqa: PLC0415
        from matplotlib.patches import Patch  # noqa: PLC0415
    except ImportError as err:
        raise MissingDependencyError(
            "PNG output needs matplotlib (pip install matplotlib); --svg needs nothing"
        ) from err
    ranks = timeline.program.num_ranks
    figure, axes = pyplot.subplots(figsize=(min(24, 4 + timeline.makespan / 4), 1 + ranks * 0.45))
    for box in boxes(timeline):
        height, bottom = (
            (0.8, box.rank - 0.4) if not box.band else (0.4, box.rank - 0.4 + (box.band - 1) * 0.4)
        )
        axes.broken_barh(
            [(box.start, box.end - box.start)],
            (bottom, height),
            facecolors=colour(box),
            edgecolor="white",
            linewidth=0.5,
        )
        if box.end - box.start >= timeline.makespan / 80:
            axes.text(
                (box.start + box.end) / 2,
                bottom + height / 2,
                str(box.mb),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if box.chunk == 0 else "#1a1a1a",
            )
    if arrows:
        for src, sent, dst, arrived, _ in messages(timeline):
            axes.annotate(
                "",
                xy=(arrived, dst),
                xytext=(sent, src),
                arrowprops={"arrowstyle": "->", "lw": 0.4, "alpha": 0.5},
            )
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.invert_yaxis()
    axes.set_xlabel(f"time ({timeline.costs.unit or 'units'})")
    axes.set_title(
        f"{timeline.program.schedule}  makespan {timeline.makespan:g}  "
        f"bubble {timeline.bubble_ratio:.1%}",
        fontsize=10,
    )
    legend = [Patch(color=COLOURS[k][c], label=f"{k.value}{c}") for k in Kind for c in (0, 1)]
    axes.legend(handles=legend, ncol=8, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    figure.tight_layout()
    figure.savefig(path, dpi=150)
    pyplot.close(figure)
