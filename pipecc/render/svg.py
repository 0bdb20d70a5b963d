"""An SVG Gantt chart of a simulated step (no dependency).

The layout is computed before anything is drawn: the title wraps to the picture's width,
the time axis and its label sit under the rank rows, and the legend's rows start below the
axis label, wrapping to the width too, so nothing is drawn over anything else."""

from __future__ import annotations

from html import escape

from pipecc.render.boxes import (
    FUSED_NOTE,
    Box,
    boxes,
    colour,
    ink,
    legend,
    messages,
    num_chunks,
    tick_step,
    title,
    wrap,
)
from pipecc.simulate.timeline import Timeline

ROW, LEFT, RIGHT = 26, 64, 16
MIN_WIDTH = 420
TITLE_SIZE, TITLE_LINE = 13, 17
AXIS = 40  # the axis line, its tick labels and the axis label under the rows
KEY_ROW = 18  # one row of the legend
CHAR = 0.6  # a character's width as a fraction of the font size (Helvetica, on average)


def render_svg(
    timeline: Timeline, *, arrows: bool = False, px_per_unit: float | None = None
) -> str:
    """An SVG Gantt chart: rank rows, op boxes with microbatch numbers, time axis, legend."""
    span = timeline.makespan or 1.0
    scale = px_per_unit or max(4.0, min(40.0, 1400.0 / span))
    ranks = timeline.program.num_ranks
    width = max(MIN_WIDTH, LEFT + span * scale + RIGHT)
    heading = wrap(title(timeline), int((width - LEFT - RIGHT) / (TITLE_SIZE * CHAR)))
    top = 12 + TITLE_LINE * len(heading)
    bottom = top + ranks * ROW
    drawn = boxes(timeline)
    chunks = num_chunks(timeline)
    key, key_rows = _svg_legend(bottom + AXIS + 12, width, drawn, chunks)
    height = bottom + AXIS + key_rows * KEY_ROW + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    parts.extend(
        f'<text class="title" x="{LEFT}" y="{16 + TITLE_LINE * i}" font-size="{TITLE_SIZE}">'
        f"{escape(line)}</text>"
        for i, line in enumerate(heading)
    )
    for rank in range(ranks):
        y = top + rank * ROW
        parts.append(
            f'<text x="{LEFT - 8}" y="{y + ROW / 2 + 4}" text-anchor="end">rank {rank}</text>'
        )
        parts.append(
            f'<rect x="{LEFT}" y="{y + 1}" width="{span * scale:.2f}" '
            f'height="{ROW - 2}" fill="#f4f4f4"/>'
        )
    parts.extend(_svg_box(box, scale, top, chunks) for box in drawn)
    if arrows:
        parts.extend(_svg_arrow(m, scale, top) for m in messages(timeline))
    parts.append(_svg_axis(span, scale, bottom, timeline.costs.unit or "units"))
    parts.append(key)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _svg_box(box: Box, scale: float, top: float, chunks: int) -> str:
    x = LEFT + box.start * scale
    w = max(0.5, (box.end - box.start) * scale - 0.6)
    y: float = top + box.rank * ROW + 1
    h: float = ROW - 2
    if box.band:
        h = (ROW - 2) / 2
        y += (box.band - 1) * h
    fill = colour(box, chunks)
    text = ""
    if w >= 9:
        size = min(11.0, h * 0.8)
        text = (
            f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + size * 0.35:.2f}" '
            f'text-anchor="middle" font-size="{size:.1f}" fill="{ink(fill)}">{box.mb}</text>'
        )
    tip = f"{box.kind.value}{box.chunk}.{box.mb}  {box.start:g}–{box.end:g}"
    return (
        f'<g><title>{tip}</title><rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" '
        f'height="{h:.2f}" fill="{fill}" stroke="white" stroke-width="0.5"/>{text}'
        "</g>"
    )


def _svg_arrow(message: tuple[int, float, int, float, str], scale: float, top: float) -> str:
    src, sent, dst, arrived, label = message
    x1, y1 = LEFT + sent * scale, top + src * ROW + ROW / 2
    x2, y2 = LEFT + arrived * scale, top + dst * ROW + ROW / 2
    return (
        f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" stroke="#333" '
        f'stroke-width="0.6" stroke-opacity="0.5"><title>{escape(label)}</title></line>'
    )


def _svg_axis(span: float, scale: float, y: float, unit: str) -> str:
    step = tick_step(span, int(span * scale / 60) * 10 or 10)
    parts = [
        f'<line x1="{LEFT}" y1="{y + 2}" x2="{LEFT + span * scale:.2f}" y2="{y + 2}" '
        'stroke="#333"/>'
    ]
    tick = 0.0
    while tick <= span + 1e-9:
        x = LEFT + tick * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y + 2}" x2="{x:.2f}" y2="{y + 6}" stroke="#333"/>')
        parts.append(f'<text x="{x:.2f}" y="{y + 17}" text-anchor="middle">{tick:g}</text>')
        tick += step
    parts.append(
        f'<text class="axis-label" x="{LEFT + span * scale / 2:.2f}" y="{y + 32}" '
        f'text-anchor="middle">time ({escape(unit)})</text>'
    )
    return "\n".join(parts)


def _svg_legend(y: float, width: float, drawn: list[Box], chunks: int) -> tuple[str, int]:
    """One entry per op kind and chunk the chart shows, in rows that fit the width, from
    baseline `y`; and the number of rows."""
    entries: list[tuple[str, str | None]] = list(legend(drawn, chunks))
    if any(box.band for box in drawn):
        entries.append((FUSED_NOTE, None))
    parts = ['<g class="legend">']
    x, rows = float(LEFT), 1
    for label, fill in entries:
        size = (16 if fill else 0) + len(label) * 11 * CHAR + 18
        if x > LEFT and x + size > width - RIGHT:
            x, rows = float(LEFT), rows + 1
        row_y = y + (rows - 1) * KEY_ROW
        if fill:
            parts.append(
                f'<rect x="{x:.1f}" y="{row_y - 9}" width="12" height="12" fill="{fill}"/>'
            )
        grey = "" if fill else ' fill="#555"'
        parts.append(
            f'<text x="{x + (16 if fill else 0):.1f}" y="{row_y + 1}"{grey}>{escape(label)}</text>'
        )
        x += size
    parts.append("</g>")
    return "\n".join(parts), rows
